"""Quantized weights from every source, through capture -> freeze-semantics -> canonicalize-axes -> fuse-qdq.

Models: an MLP (70 -> 64 -> 16: K = 70 leaves a short tail group), a tiny transformers Llama (tied and
untied embeddings) and a tiny BERT. Sources, all real libraries:

- built-in RTN: ``qcompiler.quantize(model, scheme)`` for w8-channel, w4-g32, w4-g128-asym, w2-g16-asym;
- torchao ``quantize_``: IntxWeightOnlyConfig int4 PerGroup(32) (symmetric and asymmetric), int8
  PerAxis(0), Int8WeightOnlyConfig; then ``adopt_torchao`` and ``capture(..., effective=...)``;
- PT2E (torchao.quantization.pt2e): a weight-only custom ``Quantizer`` per channel (int4 range in
  int8) and group-wise (``AffineQuantizedMinMaxObserver``, PerGroup(32)), and the stock
  ``X86InductorQuantizer`` static config (activation q/dq stay explicit).

Each (model, source) is captured once per module (``compiled``). For every case: capture keeps the
dynamic dims; the pipeline output verifies (with bytes), prints, re-parses and verifies again; every
quantized linear is a ``q.linear``; and the reference decode of every ``q.weight`` equals, bit for bit,
the source's own dequantized weight read from the source (built-in ``dequantized_weight()``, torchao
``dequantize()`` before adoption, the PT2E dequantize op run on the converted model's codes).

torchao (``quantize_`` and the PT2E group-wise observer) requires K to be a multiple of the group
size, so on the MLP the int4 PerGroup(32) sources quantize only fc2 (K = 64); fc1 (K = 70) stays float.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import numpy as np
import pytest
import torch
from torch import fx, nn
from torch.export import Dim
from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
from torchao.quantization.granularity import PerAxis, PerGroup
from torchao.quantization.pt2e import PerChannelMinMaxObserver, allow_exported_model_train_eval
from torchao.quantization.pt2e._affine_quantization import AffineQuantizedMinMaxObserver
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)
from torchao.quantization.quant_primitives import MappingType
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from qcompiler.errors import PassError
from qcompiler.frontend import capture
from qcompiler.frontend.hf import wrap_hf
from qcompiler.ir import Graph, Module, Op, QuantType, parse_module, print_module, verify_module
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.blobs import put_array, read_array
from qcompiler.ir.core import TensorDecl
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.reference import decode
from qcompiler.passes.manager import PassManager
from qcompiler.passes.spec import parse_pipeline
from qcompiler.quant.modules import QuantLinear, quantize, swap_module
from qcompiler.quant.rtn import AffineQuant
from qcompiler.quant.torchao_adopt import adopt_torchao

PIPELINE = "freeze-semantics,canonicalize-axes,fuse-qdq"
INT4: torch.dtype = torch.int4  # pyright: ignore[reportAttributeAccessIssue]  (not in torch's stubs)
DynamicSpec = Mapping[str, Mapping[int, Any]]

# ------------------------------------------------------------------------------------------ models


class MLP(nn.Module):
    """70 -> 64 -> 16 with relu: K = 70 is not a multiple of 32 or 16 (a short tail group)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(70, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_model(model: str) -> nn.Module:
    """A fresh model with fixed weights (the same weights every call)."""
    torch.manual_seed(0)
    if model == "mlp":
        return MLP().eval()
    if model in ("llama", "llama-tied"):
        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=64,
            tie_word_embeddings=model == "llama-tied",
        )
        return LlamaForCausalLM(cfg).eval()
    assert model == "bert"
    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
    )
    return BertModel(cfg, add_pooling_layer=False).eval()


@dataclass
class Target:
    """What ``capture`` gets: the module, example inputs, dynamic dims, and the dims we expect back."""

    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    dynamic: DynamicSpec
    name: str
    arg_shapes: list[tuple[int | str, ...]]


def target_of(model: str, m: nn.Module) -> Target:
    if model == "mlp":
        x = torch.randn(2, 70, generator=torch.Generator().manual_seed(1))
        return Target(m, (x,), {"x": {0: "batch"}}, "mlp", [("?batch", 70)])
    c = wrap_hf(m, model)
    shapes: list[tuple[int | str, ...]] = [("?batch", "?seq")] * (1 if model.startswith("llama") else 2)
    return Target(c.module, c.inputs, c.dynamic, c.name, shapes)


# ------------------------------------------------------------------------------------------ sources


@dataclass
class SourceWeight:
    """One quantized weight as its source states it: codes and the source's own dequantized weight."""

    name: str | None
    """The weight's name in the model (``fc1.weight``), when the source keeps it."""
    codes: np.ndarray
    effective: np.ndarray


def builtin_truth(m: nn.Module) -> list[SourceWeight]:
    out: list[SourceWeight] = []
    for fqn, mod in m.named_modules():
        if isinstance(mod, QuantLinear):
            codes: Any = mod.codes
            with torch.no_grad():
                eff = mod.dequantized_weight()
            out.append(SourceWeight(f"{fqn}.weight", to_np(codes), to_np(eff)))
    return out


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy().copy()


def torchao_config(source: str) -> Any:
    if source == "ao-int4":
        return IntxWeightOnlyConfig(weight_dtype=INT4, granularity=PerGroup(32))
    if source == "ao-int4-asym":
        return IntxWeightOnlyConfig(weight_dtype=INT4, granularity=PerGroup(32), mapping_type=MappingType.ASYMMETRIC)
    if source == "ao-int8-axis":
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    assert source == "ao-int8wo"
    return Int8WeightOnlyConfig()


def group_fits(k: int, source: str) -> bool:
    """torchao asserts K % group == 0 for PerGroup; per-channel sources take every K."""
    return k % 32 == 0 if source in ("ao-int4", "ao-int4-asym", "pt2e-group") else True


def apply_torchao(m: nn.Module, source: str) -> tuple[list[SourceWeight], dict[str, torch.Tensor], AoState]:
    """quantize_ + adopt_torchao. Returns the truth (read from the subclasses before adoption), the
    effective weights for capture, and torchao's raw codes/scales by module name."""

    def wanted(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and group_fits(mod.in_features, source)

    quantize_(m, torchao_config(source), filter_fn=wanted)
    truth: list[SourceWeight] = []
    state: AoState = {}
    for fqn, mod in m.named_modules():
        w: Any = getattr(mod, "weight", None)
        if type(w).__module__.startswith("torchao"):
            with torch.no_grad():
                truth.append(SourceWeight(f"{fqn}.weight", to_np(w.qdata), to_np(w.dequantize())))
            state[fqn] = (w.qdata.detach().clone(), w.scale.detach().clone())
    return truth, adopt_torchao(m), state


AoState = dict[str, tuple[torch.Tensor, torch.Tensor]]


class WeightOnly(Quantizer):
    """Annotates the weight of every ``aten.linear`` whose K the spec can group."""

    def __init__(self, spec: QuantizationSpec, group: int | None) -> None:
        super().__init__()
        self.spec = spec
        self.group = group

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        for n in model.graph.nodes:
            if n.op != "call_function" or n.target != torch.ops.aten.linear.default:
                continue
            w = n.args[1]
            k = int(w.meta["val"].shape[-1])
            if self.group is None or k % self.group == 0:
                n.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={w: self.spec}, _annotated=True
                )
        return model

    def validate(self, model: fx.GraphModule) -> None:
        return None


def pt2e_quantizer(source: str) -> Quantizer:
    if source == "pt2e-x86":
        return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    if source == "pt2e-channel":
        observer = PerChannelMinMaxObserver.with_args(eps=2**-12)
        group = None
    else:
        observer = AffineQuantizedMinMaxObserver.with_args(
            mapping_type=MappingType.SYMMETRIC,
            target_dtype=torch.int8,
            granularity=PerGroup(32),
            quant_min=-8,
            quant_max=7,
            eps=2**-12,
        )
        group = 32
    spec = QuantizationSpec(
        dtype=torch.int8,
        quant_min=-8,
        quant_max=7,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
        observer_or_fake_quant_ctr=observer,
    )
    return WeightOnly(spec, group)


class Pt2eX(nn.Module):
    """Holds a converted PT2E GraphModule. capture() calls ``.eval()``, which a converted GraphModule
    refuses (and, once allowed, returns None), so it is captured inside a plain module."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gm(x)


class Pt2eIds(Pt2eX):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.gm(input_ids)


class Pt2eIdsMask(Pt2eX):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.gm(input_ids, attention_mask)


def export_dims(dynamic: DynamicSpec) -> dict[str, dict[int, Dim]]:
    """The same dims capture() will ask for, as torch.export Dims (shared by name)."""
    dims: dict[str, Dim] = {}
    out: dict[str, dict[int, Dim]] = {}
    for arg, axes in dynamic.items():
        for axis, d in axes.items():
            name, lo, hi = (d, 2, 4096) if isinstance(d, str) else d
            out.setdefault(arg, {})[axis] = dims.setdefault(name, Dim(name, min=lo, max=hi))
    return out


PT2E_DEQUANT = ("quantized_decomposed.dequantize_per_channel", "torchao.dequantize_affine")


def pt2e_truth(gm: fx.GraphModule) -> list[SourceWeight]:
    """Run every weight dequantize node of the converted model on its frozen codes and qparams."""

    def value(a: Any) -> Any:
        return reduce(getattr, str(a.target).split("."), gm) if isinstance(a, fx.Node) else a

    out: list[SourceWeight] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not str(n.target).startswith(PT2E_DEQUANT):
            continue
        src = n.args[0]
        if not (isinstance(src, fx.Node) and src.op == "get_attr"):
            continue  # an activation
        with torch.no_grad():
            eff = n.target(*[value(a) for a in n.args], **{k: value(v) for k, v in n.kwargs.items()})
        out.append(SourceWeight(None, to_np(value(src)), to_np(eff)))
    return out


def apply_pt2e(t: Target, source: str) -> tuple[Target, list[SourceWeight]]:
    with torch.no_grad():
        gm = torch.export.export(t.module, t.inputs, dynamic_shapes=export_dims(t.dynamic)).module()
        prepared = prepare_pt2e(gm, pt2e_quantizer(source))
        prepared(*t.inputs)
        converted = convert_pt2e(prepared)
    allow_exported_model_train_eval(converted)
    params = list(inspect.signature(converted.forward).parameters)
    wrapper = {1: Pt2eIds, 2: Pt2eIdsMask}[len(params)] if params[0] == "input_ids" else Pt2eX
    return Target(wrapper(converted), t.inputs, t.dynamic, t.name, t.arg_shapes), pt2e_truth(converted)


# ------------------------------------------------------------------------------------------ cases

BUILTIN = ("w8-channel", "w4-g32", "w4-g128-asym", "w2-g16-asym")
TORCHAO = ("ao-int4", "ao-int4-asym", "ao-int8-axis", "ao-int8wo")
PT2E = ("pt2e-channel", "pt2e-group")

CASES: list[tuple[str, str]] = [
    # the MLP takes every source
    *(("mlp", s) for s in (*BUILTIN, *TORCHAO, *PT2E, "pt2e-x86")),
    # each transformers model takes each kind of source (built-in, torchao, PT2E)
    ("llama", "w4-g32"),
    ("llama", "ao-int4"),
    ("llama", "ao-int8wo"),
    ("llama", "pt2e-group"),
    ("llama-tied", "w8-channel"),
    ("llama-tied", "ao-int4-asym"),
    ("llama-tied", "pt2e-channel"),
    ("bert", "w4-g128-asym"),
    ("bert", "ao-int8-axis"),
    ("bert", "pt2e-group"),
]
IDS = [f"{m}-{s}" for m, s in CASES]


@dataclass
class Compiled:
    """One (model, source): the captured text (to copy from), the pipeline output, and the truth."""

    target: Target
    captured: str
    out: Module
    truth: list[SourceWeight]
    ao_state: AoState = field(default_factory=dict[str, tuple[torch.Tensor, torch.Tensor]])


def compile_case(model: str, source: str) -> Compiled:
    m = make_model(model)
    effective: dict[str, torch.Tensor] | None = None
    state: AoState = {}
    if source in BUILTIN:
        quantize(m, source)
        truth = builtin_truth(m)
        t = target_of(model, m)
    elif source in TORCHAO:
        truth, effective, state = apply_torchao(m, source)
        t = target_of(model, m)
    else:
        t, truth = apply_pt2e(target_of(model, m), source)
    captured = capture(t.module, t.inputs, dynamic=t.dynamic, name=t.name, effective=effective)
    text = print_module(captured)
    out = run(PIPELINE, captured)
    return Compiled(t, text, out, truth, state)


def run(pipeline: str, m: Module) -> Module:
    return PassManager(parse_pipeline(pipeline)).run(m)


@pytest.fixture(scope="module")
def compiled() -> Callable[[str, str], Compiled]:
    """``compiled(model, source)``: captured and compiled once per test module."""
    cache: dict[tuple[str, str], Compiled] = {}

    def get(model: str, source: str) -> Compiled:
        if (model, source) not in cache:
            cache[model, source] = compile_case(model, source)
        return cache[model, source]

    return get


# ------------------------------------------------------------------------------------------ helpers


def producers(g: Graph) -> dict[int, Op]:
    return {id(r): op for op in g.ops for r in op.results}


def ops(m: Module, name: str) -> list[Op]:
    return [op for op in m.ops() if op.name == name]


def parts_of(m: Module, w: Op) -> dict[str, np.ndarray]:
    """The arrays bound to a q.weight, by slot (codes and every qparam)."""
    out: dict[str, np.ndarray] = {}
    for slot, ref in w.attrs.items():
        assert isinstance(ref, SymbolRef), f"{w.describe()}: slot {slot} is not a plain tensor"
        out[slot] = read_array(m, ref.name)
    return out


def weight_type(w: Op) -> QuantType:
    t = w.result.type
    assert isinstance(t, QuantType)
    return t


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def match(truth: list[SourceWeight], codes: np.ndarray) -> SourceWeight:
    found = [s for s in truth if s.codes.shape == codes.shape and np.array_equal(s.codes, codes)]
    assert len(found) == 1, f"{len(found)} source weights have these codes {codes.shape}"
    return found[0]


def copy_of(text: str) -> Module:
    """A fresh module from printed text (blobs stay in this process's store)."""
    return parse_module(text)


def by_codes(m: Module) -> dict[tuple[tuple[int, ...], bytes], tuple[QuantType, np.ndarray]]:
    """Every q.weight keyed by its codes: (descriptor, reference decode)."""
    out: dict[tuple[tuple[int, ...], bytes], tuple[QuantType, np.ndarray]] = {}
    for w in ops(m, "q.weight"):
        parts = parts_of(m, w)
        t = weight_type(w)
        out[parts["codes"].shape, parts["codes"].astype(np.int8).tobytes()] = (t, np.asarray(decode(t, parts)))
    return out


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize(("model", "source"), CASES, ids=IDS)
def test_capture_keeps_dynamic_dims_and_one_source_weight_per_quantized_weight(
    compiled: Callable[[str, str], Compiled], model: str, source: str
) -> None:
    c = compiled(model, source)
    captured = copy_of(c.captured)
    g = captured.graphs[0]
    assert [a.type.shape for a in g.args] == c.target.arg_shapes  # type: ignore[union-attr]
    sources = ops(captured, "q.source_weight")
    assert c.truth
    assert len(sources) == len(c.truth)
    users = g.users()
    for sw in sources:
        assert [(u.name, u.operands[1] is sw.result) for u in users[id(sw.result)]] == [("linear", True)]


@pytest.mark.parametrize(("model", "source"), CASES, ids=IDS)
def test_pipeline_output_verifies_and_reparses(
    compiled: Callable[[str, str], Compiled], model: str, source: str
) -> None:
    out = compiled(model, source).out
    assert out.invariants == ["semantics-frozen", "axes-canonical", "qdq-fused"]
    verify_module(out, data=True)
    text = print_module(out)
    again = parse_module(text)
    verify_module(again, data=True)
    assert print_module(again) == text


@pytest.mark.parametrize(("model", "source"), CASES, ids=IDS)
def test_every_quantized_linear_is_q_linear(compiled: Callable[[str, str], Compiled], model: str, source: str) -> None:
    c = compiled(model, source)
    out = c.out
    g = out.graphs[0]
    made_by, users = producers(g), g.users()
    assert not ops(out, "q.source_weight")
    weights = ops(out, "q.weight")
    assert len(weights) == len(c.truth)
    for w in weights:
        assert [(u.name, u.operands[1] is w.result) for u in users[id(w.result)]] == [("q.linear", True)]
        assert weight_type(w).group is not None
        assert weight_type(w).group.axis == 1  # type: ignore[union-attr]
    assert len(ops(out, "q.linear")) == len(c.truth)
    for lin in ops(out, "linear"):  # what is left dense has a float weight
        src = made_by.get(id(lin.operands[1]))
        assert src is not None
        assert src.name == "const", f"{lin.describe()} takes its weight from {src.name}"
    quantizes, dequantizes = ops(out, "q.quantize"), ops(out, "q.dequantize")
    if source == "pt2e-x86":  # activations stay explicit: x and relu(fc1) are quantized statically
        assert len(quantizes) == len(dequantizes) == 2
        for dq in dequantizes:
            assert made_by[id(dq.operands[0])].name == "q.quantize"
        assert {made_by[id(q.operands[0])].name for q in ops(out, "q.linear")} == {"q.dequantize"}
    else:
        assert not quantizes
        assert not dequantizes


@pytest.mark.parametrize(("model", "source"), CASES, ids=IDS)
def test_reference_decode_equals_the_sources_own_dequantize(
    compiled: Callable[[str, str], Compiled], model: str, source: str
) -> None:
    c = compiled(model, source)
    seen: set[int] = set()
    for w in ops(c.out, "q.weight"):
        parts = parts_of(c.out, w)
        src = match(c.truth, parts["codes"])
        seen.add(id(src))
        codes_ref = w.attrs["codes"]
        assert isinstance(codes_ref, SymbolRef)
        if src.name is not None:
            assert codes_ref.name == f"{src.name}.codes"
        got = np.asarray(decode(weight_type(w), parts))
        assert got.dtype == np.float32
        assert got.shape == src.effective.shape
        diff = np.argwhere(bits(got) != bits(src.effective))
        assert diff.size == 0, f"{codes_ref}: decode differs from the source at {diff[0].tolist()}"
    assert len(seen) == len(c.truth)


def test_same_codes_give_the_same_descriptors_whatever_the_source(compiled: Callable[[str, str], Compiled]) -> None:
    """torchao int4 PerGroup(32), PT2E group-wise (whose observer finds the same codes and scales), and
    built-in QuantLinears holding torchao's qdata/scale: equal descriptors (and decodes) per weight."""
    ao = compiled("llama", "ao-int4")
    pt2e = compiled("llama", "pt2e-group")
    m = make_model("llama")
    for fqn, (qdata, scale) in ao.ao_state.items():
        mod = m.get_submodule(fqn)
        assert isinstance(mod, nn.Linear)
        q = AffineQuant(codes=qdata, scale=scale, zero=None, qmin=-8, qmax=7, group=32)
        swap_module(m, fqn, QuantLinear(q, mod.bias, torch.float32, {"kind": "test: torchao codes"}))
    t = target_of("llama", m)
    builtin = run(PIPELINE, capture(t.module, t.inputs, dynamic=t.dynamic, name=t.name))

    a, b, p = by_codes(ao.out), by_codes(builtin), by_codes(pt2e.out)
    assert len(a) == len(ao.truth) == 15
    assert set(a) == set(b) == set(p)
    for key, (t_ao, v_ao) in a.items():
        t_b, v_b = b[key]
        t_p, v_p = p[key]
        assert t_ao == t_b == t_p
        assert t_ao.group is not None
        assert (t_ao.code.dtype.name, t_ao.group.size, [n for n, _ in t_ao.qparams]) == ("i4", 32, ["scale"])
        assert np.array_equal(bits(v_ao), bits(v_b))
        assert np.array_equal(bits(v_ao), bits(v_p))


# ------------------------------------------------------------------------------------------ refusals


def test_declared_scheme_mismatch_is_refused_naming_the_tensor(compiled: Callable[[str, str], Compiled]) -> None:
    m = copy_of(compiled("mlp", "w4-g32").captured)
    with pytest.raises(PassError) as e:
        run("freeze-semantics{scheme=w8-channel}", m)
    assert "tensor @fc1.weight: quantized as w4-g32, but the declared scheme is w8-channel" in str(e.value)


@pytest.mark.parametrize("scheme", BUILTIN)
def test_declared_scheme_that_matches_is_accepted(compiled: Callable[[str, str], Compiled], scheme: str) -> None:
    """A model quantized as ``scheme`` passes ``freeze-semantics{scheme=...}``, whatever K is (K = 70
    and 64 are below 128, so w4-g128-asym has one short group per row)."""
    m = run(f"freeze-semantics{{scheme={scheme}}}", copy_of(compiled("mlp", scheme).captured))
    assert len(ops(m, "q.weight")) == 2


def test_corrupted_effective_weight_is_refused_naming_tensor_and_index(
    compiled: Callable[[str, str], Compiled],
) -> None:
    m = copy_of(compiled("mlp", "w4-g32").captured)
    sw = next(op for op in ops(m, "q.source_weight") if str(op.attrs["codes"]) == "@fc2.weight.codes")
    ref = sw.attrs["effective"]
    assert isinstance(ref, SymbolRef)
    tampered = read_array(m, ref.name).copy()
    tampered[5, 33] = np.nextafter(tampered[5, 33], np.float32(np.inf))
    m.tensors["fc2.weight.tampered"] = TensorDecl("fc2.weight.tampered", put_array(tampered, DTYPES["f32"]))
    sw.attrs["effective"] = SymbolRef("fc2.weight.tampered")
    verify_module(m, data=True)
    with pytest.raises(PassError) as e:
        run("freeze-semantics", m)
    msg = str(e.value)
    assert "tensor @fc2.weight: reference decode differs from the source's effective weight at [5, 33]" in msg
    assert "1 of 1024 differ" in msg


def test_the_proof_by_row_blocks_names_the_weights_own_index(
    compiled: Callable[[str, str], Compiled], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the source's dequantize a weight is proven a block of rows at a time; a difference in
    a later block is reported at its index in the weight, with the block it was found in."""
    from qcompiler.passes import freeze_proof

    m = copy_of(compiled("mlp", "w4-g32").captured)
    sw = next(op for op in ops(m, "q.source_weight") if str(op.attrs["codes"]) == "@fc2.weight.codes")
    del sw.attrs["effective"]  # held to qcompiler::dequantize_affine of its codes, as a streamed source is
    source_rows = freeze_proof.Affine.rows

    def off_by_one_ulp(self: freeze_proof.Affine, r0: int, r1: int) -> np.ndarray:
        out = source_rows(self, r0, r1).copy()
        if self.codes.shape == (16, 64) and r0 <= 5 < r1:
            out[5 - r0, 3] = np.nextafter(out[5 - r0, 3], np.float32(np.inf))
        return out

    monkeypatch.setattr(freeze_proof, "PROOF_ELEMENTS", 128)  # 2 rows of K = 64 a block
    monkeypatch.setattr(freeze_proof.Affine, "rows", off_by_one_ulp)
    with pytest.raises(PassError) as e:
        run("freeze-semantics", m)
    msg = str(e.value)
    assert "tensor @fc2.weight: reference decode differs from the source's effective weight at [5, 3]" in msg
    assert "1 of 128 in rows [4, 6) differ" in msg
