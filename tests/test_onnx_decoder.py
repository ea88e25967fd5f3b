"""A causal LM's ``model.onnx`` is the KV-cache decoder graph onnxruntime-genai and optimum run.

Against the real peers (onnxruntime; tiny random transformers models saved by ``save_pretrained``):
the signature (names, dtypes, dim names) of Llama, a sliding-window family (Mistral) and a MoE family
(Mixtral); greedy decoding through the cache equal to the artifact's full-sequence QIR graph; a
left-padded batch decoding each row as its prompt alone (the attention mask and per-row positions);
the no-cache graph only with ``--onnx-no-cache-graph``; and the reader refusing a swapped or edited
graph by the field that differs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import transformers
from onnx import TensorProto
from onnx_peers import assert_padded_batches_decode_as_alone, decode_against_graph, rel_l2, session

from qcompiler.artifact.reader import ArtifactError, open_artifact
from qcompiler.backends.onnx.feeds import prefill_feed, run
from qcompiler.testing import rehash, run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"
COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
GEMMA2: dict[str, Any] = {
    **COMMON,
    "num_hidden_layers": 4,
    "initializer_range": 0.2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 6,
    "attn_logit_softcapping": 5.0,
    "final_logit_softcapping": 3.0,
}
MODELS: dict[str, Any] = {
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=6)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**GEMMA2)),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    ),
}
"""Tiny random models: Mistral and Gemma2 slide a window of 6 (shorter than every decode here), Gemma2
soft-caps its scores (weights 10x the default scale so the cap bites), Mixtral routes over experts."""
ARTIFACTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "llama-nbits": (LLAMA, "onnx-nbits", ("--onnx-no-cache-graph",)),
    "llama-qdq": (LLAMA, "onnx-qdq", ()),
    "mistral": ("mistral", "onnx-nbits", ()),
    "gemma2": ("gemma2", "onnx-nbits", ()),
    "mixtral": ("mixtral", "onnx-nbits", ()),
}
"""artifact -> (source, target, extra flags), each w4-g32."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {}


def artifact(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """``name``'s artifact, compiled once per module."""
    if name in built:
        return built[name]
    src, target, extra = ARTIFACTS[name]
    root = tmp_path_factory.mktemp(name)
    if src in MODELS:
        torch.manual_seed(0)
        MODELS[src]().save_pretrained(root / "src")
        src = str(root / "src")
    out = root / "art"
    r = run_cli("compile", src, "--scheme", "w4-g32", "--target", target, "-o", str(out), "--quiet", *extra)
    assert r.code == 0, r.err
    built[name] = out
    return out


@pytest.fixture
def art(request: pytest.FixtureRequest, built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return artifact(built, tmp_path_factory, request.param)


def dims(v: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]


@pytest.mark.parametrize(("art", "vocab"), [("llama-nbits", 128), ("mistral", 256), ("mixtral", 256)], indirect=["art"])
def test_the_signature_is_the_one_genai_and_optimum_use(art: Path, vocab: int) -> None:
    """Inputs, outputs, dtypes and dim names exactly as optimum and onnxruntime-genai name them: two
    layers, 2 key/value heads of 16."""
    model = onnx.load(str(art / "model.onnx"), load_external_data=False)
    batch, seq, past, total = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    want_in = [
        ("input_ids", i64, [batch, seq]),
        ("attention_mask", i64, [batch, total]),
        ("position_ids", i64, [batch, seq]),
    ]
    want_out: list[tuple[str, int, list[int | str]]] = [("logits", f32, [batch, seq, vocab])]
    for i in range(2):
        want_in += [(f"past_key_values.{i}.{kv}", f32, [batch, 2, past, 16]) for kv in ("key", "value")]
        want_out += [(f"present.{i}.{kv}", f32, [batch, 2, total, 16]) for kv in ("key", "value")]
    got_in = [(v.name, v.type.tensor_type.elem_type, dims(v)) for v in model.graph.input]
    got_out = [(v.name, v.type.tensor_type.elem_type, dims(v)) for v in model.graph.output]
    assert got_in == want_in
    assert got_out == want_out
    sess = session(art / "model.onnx")  # onnxruntime reads the same signature
    assert [(i.name, i.type, i.shape) for i in sess.get_inputs()] == [
        (n, "tensor(int64)" if t == i64 else "tensor(float)", d) for n, t, d in want_in
    ]
    assert not (art / "model_with_past.onnx").exists()


@pytest.mark.parametrize("art", ["llama-nbits", "llama-qdq", "mistral", "gemma2"], indirect=True)
def test_greedy_decoding_through_the_cache_is_the_graphs(art: Path) -> None:
    """A prefill of 4 tokens at batch 2, then 16 greedy steps one token a run: each step's token is the
    one the artifact's full-sequence QIR graph chooses, its logits within 1e-5 rel-L2 of the graph's."""
    _, errs = decode_against_graph(art)
    print(f"{art.parent.name}: 16 greedy tokens equal; last {errs[-1]:.2e}, worst {max(errs):.2e} rel-L2")
    assert errs[-1] <= 1e-5
    assert max(errs) <= 1e-5


@pytest.mark.parametrize("art", ["llama-nbits", "mistral", "gemma2"], indirect=True)
def test_a_left_padded_batch_decodes_each_prompt_as_alone(art: Path) -> None:
    """Prompts of 3 and 7 tokens, the short one left-padded: 12 greedy tokens each, equal to the prompt
    run alone at batch 1, last-position logits within 1e-5 rel-L2; every logit stays finite (a padding
    query sees no key). Then a batch of two 5-token prompts without padding, the same way."""
    assert_padded_batches_decode_as_alone(art)


@pytest.mark.parametrize("art", ["llama-nbits"], indirect=True)
def test_the_no_cache_graph_is_written_only_when_asked(
    art: Path, built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """``--onnx-no-cache-graph`` adds ``model_no_cache.onnx`` (``input_ids`` in, ``logits`` out), whose
    logits are the decoder graph's prefill; without it there is none. The manifest records which; the
    dispatch proof covers both graphs. An encoder (BERT) refuses the option, a non-onnx target too."""
    plain = artifact(built, tmp_path_factory, "llama-qdq")
    assert not (plain / "model_no_cache.onnx").exists()
    assert json.loads((plain / "manifest.json").read_text())["provenance"]["no_cache_graph"] is False
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["provenance"]["no_cache_graph"] is True
    assert manifest["provenance"]["pipeline"].endswith("emit-container{target=onnx-nbits,no-cache-graph=true}")
    no_cache = session(art / "model_no_cache.onnx")
    assert [i.name for i in no_cache.get_inputs()] == ["input_ids"]
    assert [o.name for o in no_cache.get_outputs()] == ["logits"]
    sess = session(art / "model.onnx")
    ids = np.random.default_rng(3).integers(0, 100, (3, 11))
    err = rel_l2(no_cache.run(None, {"input_ids": ids})[0], run(sess, prefill_feed(sess, ids))["logits"])
    print(f"no-cache graph vs the decoder graph's prefill: {err:.2e} rel-L2")
    assert err <= 1e-6
    report = json.loads(run_cli("verify", str(art), "--json").out)
    assert report["ok"], report.get("error")
    assert report["dispatch"]["no_cache"]["ok"]
    assert report["dispatch"]["no_cache"]["matmulnbits"] == report["dispatch"]["quantized_linears"]
    for src, target, word in (
        ("qcompiler.examples:tiny_bert_hf", "onnx-nbits", "is not a causal LM graph"),
        (LLAMA, "gguf", "takes no option no-cache-graph"),
    ):
        out = tmp_path / target
        flags = ("--scheme", "w8-channel", "--target", target, "-o", str(out), "--onnx-no-cache-graph")
        r = run_cli("compile", src, *flags)
        assert r.code != 0
        assert word in r.err, r.err
        assert "Traceback" not in r.err, r.err
        assert not out.exists()


def refused(path: Path) -> ArtifactError:
    with pytest.raises(ArtifactError) as e:
        open_artifact(path)
    r = run_cli("verify", str(path), "--json")
    assert r.code == 1
    assert json.loads(r.out)["error"] == str(e.value)
    return e.value


@pytest.mark.parametrize("art", ["llama-nbits"], indirect=True)
def test_a_swapped_or_edited_decoder_graph_is_refused(art: Path, tmp_path: Path) -> None:
    """The manifest re-hashed each time, so only the binding gate can notice: ``model.onnx`` replaced by
    the no-cache graph, then the node that joins the causal rule and the attention mask (``And``) turned
    into an ``Or`` (padding would be attended). Each is refused naming ``model.onnx`` and the first
    differing field."""
    swapped = tmp_path / "swapped"
    shutil.copytree(art, swapped)
    shutil.copy(swapped / "model_no_cache.onnx", swapped / "model.onnx")
    rehash(swapped)
    e = refused(swapped)
    print(f"swapped: {e}")
    assert e.file == "model.onnx", str(e)
    assert e.message.startswith("differs from what graph.qir lowers to"), str(e)
    assert e.field.startswith("graph."), str(e)

    edited = tmp_path / "edited"
    shutil.copytree(art, edited)
    model = onnx.load(str(edited / "model.onnx"), load_external_data=False)
    keep = [(k, n) for k, n in enumerate(model.graph.node) if n.name == "attn_keep"]
    assert [n.op_type for _, n in keep] == ["And"]
    keep[0][1].op_type = "Or"
    (edited / "model.onnx").write_bytes(model.SerializeToString())
    rehash(edited)
    e = refused(edited)
    print(f"edited: {e}")
    assert (e.file, e.field) == ("model.onnx", f"graph.node[{keep[0][0]}] 'attn_keep'.op_type"), str(e)
    assert (e.expected, e.found) == ("'And'", "'Or'"), str(e)
