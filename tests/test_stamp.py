"""Stamping (``frontend/stamp.py``): a model of repeated layers exported with three of them and the
rest copied is the module the whole export lowers to, text for text, for each family stamped; a
model whose layers differ, or whose third layer is not its second shifted, is exported whole; value
names are numbered by the compiler (``frontend/names.py``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

from qcompiler import api
from qcompiler.frontend import stamp
from qcompiler.frontend.capture import capture, export_program, hf_config, lowered
from qcompiler.frontend.forked import placeholders
from qcompiler.frontend.names import origins, renumber
from qcompiler.frontend.stream import Prepared, prepare_hf_dir
from qcompiler.ir import print_module
from qcompiler.ir.blobs import spilled
from qcompiler.ir.core import Graph, Module, Value, create_op
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.types import DenseType

LAYERS = 6
SMALL: dict[str, Any] = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS}
HEADS: dict[str, Any] = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}

FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, **HEADS)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**SMALL, **HEADS, head_dim=16)),  # GELU's partial
    "mixtral": lambda: tf.MixtralForCausalLM(  # experts held unregistered (quant/experts.py)
        tf.MixtralConfig(**SMALL, **HEADS, num_local_experts=4, num_experts_per_tok=2)
    ),
    "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(
        tf.Qwen3MoeConfig(**SMALL, **HEADS, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    ),
    "gpt2": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64)
    ),
    "bert": lambda: tf.BertModel(
        tf.BertConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=128
        )
    ),
}
WHOLE: dict[str, Callable[[], Any]] = {
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, **HEADS, head_dim=16)),  # sliding, full, ...
    "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(  # layer 4 a dense MLP
        tf.Qwen2MoeConfig(
            **SMALL, **HEADS, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[4]
        )
    ),
    "gpt2": lambda: tf.GPT2LMHeadModel(  # attention scaled by 1 / (layer_idx + 1)
        tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=LAYERS, n_head=4, scale_attn_by_inverse_layer_idx=True)
    ),
}


def saved(root: Path, make: Callable[[], Any]) -> Path:
    torch.manual_seed(0)
    make().save_pretrained(root)
    return root


def captured(src: Path, whole: bool, monkeypatch: pytest.MonkeyPatch) -> str:
    p = prepare_hf_dir(src, "w4-g32", stand_ins=True)
    with monkeypatch.context() as mp:
        if whole:
            mp.setattr(stamp, "MIN_LAYERS", 10**6)
        c = p.cap
        m = capture(
            c.module,
            c.inputs,
            dynamic=c.dynamic,
            name=c.name,
            lazy=placeholders(p.shards, p.stand_ins),
            buffers=p.buffers,
        )
    return print_module(m, keep_comments=True)


def stamps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each ``stamp.stamp`` call ended in: ``ok`` or its error."""
    seen: list[str] = []
    real = stamp.stamp

    def spy(low: stamp.Lowered, layers: stamp.Layers) -> Module:
        try:
            m = real(low, layers)
        except stamp.NotStamped as e:
            seen.append(str(e))
            raise
        seen.append("ok")
        return m

    monkeypatch.setattr(stamp, "stamp", spy)
    return seen


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_stamped_capture_is_the_whole_one(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = saved(tmp_path / family, FAMILIES[family])
    whole = captured(src, True, monkeypatch)
    seen = stamps(monkeypatch)
    assert captured(src, False, monkeypatch) == whole
    assert seen == ["ok"]
    assert whole.count(".weight.codes") >= LAYERS * 4  # every layer's weights are in the table


@pytest.mark.parametrize("family", sorted(WHOLE))
def test_layers_that_differ_are_exported_whole(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = saved(tmp_path / family, WHOLE[family])
    exports: list[int] = []
    real = export_program

    def counted(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        exports.append(len(dict(model.named_modules())))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(importlib.import_module("qcompiler.frontend.capture"), "export_program", counted)
    captured(src, False, monkeypatch)
    assert len(exports) == 1  # the whole model, once: no cut export was tried


def cut_and_lowered(p: Prepared) -> tuple[stamp.Lowered, stamp.Layers]:
    c = p.cap
    layers = stamp.repeated_layers(c.module, hf_config(c.module))
    assert layers is not None
    with layers.cut():
        ep = export_program(c.module, c.inputs, c.dynamic)
    holes = placeholders(p.shards, p.stand_ins)
    low = lowered(ep, Module(c.name), c.module, c.inputs, c.dynamic, None, holes, p.buffers, layers.layer_of)
    return low, layers


def test_a_third_layer_unlike_the_second_is_not_stamped(tmp_path: Path) -> None:
    p = prepare_hf_dir(saved(tmp_path / "llama", FAMILIES["llama"]), "w4-g32", stand_ins=True)
    low, layers = cut_and_lowered(p)
    third = [op for op, tag in zip(low.module.graphs[0].ops, low.tags, strict=True) if tag == 2]
    rms = next(op for op in third if op.name == "full")
    rms.attrs["value"] = 1e-5  # layer 2's epsilon differs from layer 1's
    with pytest.raises(stamp.NotStamped, match="of layer 1 is not"):
        stamp.stamp(low, layers)


def test_a_head_reading_an_inner_layer_is_not_stamped(tmp_path: Path) -> None:
    p = prepare_hf_dir(saved(tmp_path / "llama", FAMILIES["llama"]), "w4-g32", stand_ins=True)
    low, layers = cut_and_lowered(p)
    ops = low.module.graphs[0].ops
    second = [op for op, tag in zip(ops, low.tags, strict=True) if tag == 1]
    third = {r for op, tag in zip(ops, low.tags, strict=True) if tag == 2 for r in op.results}
    head = next(i for i in range(len(ops) - 1, -1, -1) if low.tags[i] == 2) + 1
    reader = next(op for op in ops[head:] if any(v in third for v in op.operands))
    slot = next(i for i, v in enumerate(reader.operands) if v in third)
    reader.operands[slot] = second[-1].result  # the final norm reads layer 1's output, not layer 2's
    with pytest.raises(stamp.NotStamped, match="other than the last"):
        stamp.stamp(low, layers)


def test_the_stamped_compile_writes_the_whole_compiles_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the forked child and the stream: the same graph, tensors and container."""
    src = saved(tmp_path / "llama", FAMILIES["llama"])
    texts: list[str] = []
    for whole in (True, False):
        with monkeypatch.context() as mp, spilled(tmp_path / f"spill{whole}"):
            if whole:
                mp.setattr(stamp, "MIN_LAYERS", 10**6)
            texts.append(print_module(api.capture_source(str(src), scheme="w4-g32", jobs=2).module))
    assert texts[0] == texts[1]


def test_values_are_numbered_per_base_in_graph_order() -> None:
    t = DenseType(DTYPES["f32"], (2,))
    g = Graph("forward")
    x = Value("x", t)
    g.args.append(x)
    made: dict[str, Value] = {}
    for name in ("mul_5", "linear_7_w", "linear_7", "p_w_weight", "mul_9", "mul", "c"):
        op = create_op("neg", [x], [t], None, [name])
        g.ops.append(op)
        made[name] = op.result
    nodes = {n: n for n in ("mul", "mul_5", "mul_9", "linear_7")}
    renumber(g, origins(g.values(), nodes))
    assert [v.name for v in g.values()] == ["x", "mul", "linear_w", "linear", "p_w_weight", "mul_1", "mul_2", "c"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_used_modules_of_the_cut_model_stand_for_the_whole_ones(family: str) -> None:
    from qcompiler.frontend.hf import wrap_hf
    from qcompiler.frontend.skeleton import fake_model
    from qcompiler.frontend.source_info import used_modules
    from qcompiler.quant.experts import unfuse_experts

    torch.manual_seed(0)
    model, mode = fake_model(lambda: unfuse_experts(FAMILIES[family]()))
    cap = wrap_hf(model.eval())
    with mode:
        whole = used_modules(cap.module, cap.inputs)
        cut = stamp.used_by_layers(cap.module, hf_config(cap.module), lambda: used_modules(cap.module, cap.inputs))
    assert cut == whole
    assert any(".layers.4." in n or ".h.4." in n or ".layer.4." in n for n in whole)


def test_a_config_list_per_layer_that_differs_is_exported_whole() -> None:
    """A forward may read ``config.layer_types[layer_idx]``: the modules alone would not show it."""
    from qcompiler.frontend.hf import wrap_hf
    from qcompiler.frontend.skeleton import fake_model

    model, _ = fake_model(FAMILIES["llama"])
    cap = wrap_hf(model.eval())
    config = hf_config(cap.module)
    assert stamp.repeated_layers(cap.module, config) is not None
    config.layer_types = ["full_attention"] * (LAYERS - 1) + ["sliding_attention"]
    assert stamp.repeated_layers(cap.module, config) is None
    config.layer_types = ["sliding_attention"] + ["full_attention"] * (LAYERS - 1)  # layer 0 is exported itself
    assert stamp.repeated_layers(cap.module, config) is not None
