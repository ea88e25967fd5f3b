"""Dequantize nodes in exported graphs -> ``q.source_weight`` (weights) or ``q.quantize``/``q.dequantize``
(activations). Nothing is requantized: codes and qparams are copied as they are, and the source's own
dequantize is evaluated on them to record the effective weight ``freeze-semantics`` must reproduce.

Recognised nodes and where they come from:

- ``qcompiler::dequantize_affine(codes, scale, zero, group, qmin, qmax, dtype)``: ``qcompiler.quantize``
  and adopted torchao weights;
- ``qcompiler::dequantize_affine_gidx(codes, scale, zero, g_idx, group, qmin, qmax, dtype)``: act-order
  weights of pre-quantized checkpoints; ``g_idx`` becomes the ``q.source_weight``'s ``g_idx``
  attribute, which ``freeze-semantics`` turns into an explicit permutation;
- ``qcompiler::dequantize_f8e4m3(codes, scale, group, dtype)``: FP8 weights of a ``float-quantized``
  checkpoint (``quant/float8.py``), uint8 bit patterns; the ``q.source_weight`` says ``family = "f8e4m3"``;
- ``torchao::dequantize_affine(q, block_size, scale, zp, in_dtype, qmin, qmax)``: torchao subclasses
  after export, PT2E group-wise weights;
- ``quantized_decomposed::dequantize_per_channel(codes, scales, zps, axis, qmin, qmax, dtype)``: PT2E
  per-channel weights;
- ``quantized_decomposed::{quantize,dequantize}_per_tensor(x, scale, zp, qmin, qmax, dtype)``: PT2E
  activations (and per-tensor weights).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import fx

from qcompiler.frontend.context import Lowering, UnsupportedError, where_from
from qcompiler.frontend.lowerings import lowers
from qcompiler.frontend.skeleton import is_fake
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.core import BlobRef, Value
from qcompiler.ir.dtypes import DTYPES, code_dtype
from qcompiler.ir.types import Alphabet, CodeContract, DenseType, QuantType
from qcompiler.quant import float8 as _float8  # registers qcompiler::dequantize_f8e4m3
from qcompiler.quant import modules as _modules  # registers qcompiler::dequantize_affine
from qcompiler.quant.describe import code_type

del _modules, _float8
importlib.import_module("torch.ao.quantization.fx._decomposed")  # registers the quantized_decomposed ops
QD = torch.ops.quantized_decomposed
Args = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int], int, int]
"""codes, scale, zero, block size per dim, qmin, qmax."""


def const_of(lx: Lowering, arg: Any, n: fx.Node) -> torch.Tensor | None:
    if arg is None:
        return None
    if isinstance(arg, fx.Node) and arg.name in lx.consts:
        return lx.consts[arg.name]
    if isinstance(arg, int | float):
        return torch.tensor(arg)
    raise UnsupportedError(
        f"{n.target}: operand {arg} is not a constant, so its codes cannot be frozen: {where_from(n)}"
    )


def fqn_of(lx: Lowering, n: fx.Node) -> str:
    """The weight's name in the model (``layers.0.mlp.up_proj.weight``), the same for every source."""
    arg = n.args[0]
    name = lx.const_names.get(arg.name, arg.name) if isinstance(arg, fx.Node) else "weight"
    for part in (".codes", ".blocks"):
        if name.endswith(part):
            return name.removesuffix(part) + ".weight"
    if ".parametrizations." in name:
        return name.split(".parametrizations.")[0] + "." + name.split(".parametrizations.")[1].split(".")[0]
    for node in (n, *n.users):  # PT2E dequantize nodes carry no module stack; their consumers do
        stack = node.meta.get("nn_module_stack") or {}
        path = str(list(stack.values())[-1][0]).removeprefix("hf.") if stack else ""
        if path:
            return f"{path}.weight"
    return name


def lowered_before(lx: Lowering, n: fx.Node) -> tuple[tuple[str, ...], Value | None]:
    """The value of an identical dequantize lowered before (a tied weight read twice), and the key."""
    key = (str(n.target), *(a.name if isinstance(a, fx.Node) else repr(a) for a in n.args))
    return key, lx.dequantized.get(key)


def source_weight(
    lx: Lowering, n: fx.Node, kind: str, parts: Args, g_idx: torch.Tensor | None = None, family: str = ""
) -> Value:
    """Emit ``q.source_weight`` for a weight dequantize node whose operands are constants (once per
    tied weight: a second identical dequantize reuses the first one's value); ``g_idx``: the group
    of each column along K (act order), bound as the op's ``g_idx``; ``family``: a representation
    family other than affine (``f8e4m3``)."""
    key, before = lowered_before(lx, n)
    if before is not None:
        return before
    codes, scale, zero, block, qmin, qmax = parts
    fqn = fqn_of(lx, n)
    made = lx.lazy.get(f"{fqn}.effective")  # a source that hashed the layer's decode as it read it
    override = None if made is not None else lx.effective.get(fqn)
    effective = None
    if made is not None:
        effective = torch.empty(made.shape, device="meta")  # only its shape is read: the bytes are ``made``
    elif override is not None or not is_fake(codes):
        with torch.no_grad():
            effective = override if override is not None else evaluate(n, lx)
    elif n.target is not torch.ops.qcompiler.dequantize_affine.default:
        raise UnsupportedError(f"{n.target}: a streamed weight must come from qcompiler.quantize: {where_from(n)}")
    attrs: dict[str, AttrValue] = {
        "source": lx.sources.get(fqn, kind),
        "codes": lx.add_tensor(f"{fqn}.codes", codes),
        "scale": lx.add_tensor(f"{fqn}.scale", scale),
    }
    if zero is not None:
        attrs["zero"] = lx.add_tensor(f"{fqn}.zero", zero)
    if g_idx is not None:
        attrs["g_idx"] = lx.add_tensor(f"{fqn}.g_idx", g_idx.to(torch.int32))
    attrs.update({"block": list[AttrValue](block), "qmin": qmin, "qmax": qmax})
    if family:
        attrs["family"] = family
    if effective is not None:
        recipe = getattr(lx.effective, "derived", None)  # a source that can make the decode again
        again = recipe(fqn) if override is not None and callable(recipe) else None
        if isinstance(again, BlobRef):  # kept as a recipe, not spilled
            lx.lazy[f"{fqn}.effective"] = again
        attrs["effective"] = lx.add_tensor(f"{fqn}.effective", effective)
    else:  # evaluated by freeze-semantics, one weight at a time
        attrs["decode_op"] = "qcompiler::dequantize_affine"
    lx.dequantized[key] = lx.emit("q.source_weight", [], lx.type_of(n), attrs, name=fqn.replace(".", "_"))
    return lx.dequantized[key]


def evaluate(n: fx.Node, lx: Lowering) -> torch.Tensor:
    """Run the node's own op on its constant operands: the source's effective weight."""

    def sub(a: Any) -> Any:
        return lx.consts[a.name] if isinstance(a, fx.Node) else a

    out = n.target(*[sub(a) for a in n.args], **{k: sub(v) for k, v in n.kwargs.items()})  # type: ignore[operator]
    assert isinstance(out, torch.Tensor)
    return out


def is_const(lx: Lowering, arg: Any) -> bool:
    return isinstance(arg, fx.Node) and arg.name in lx.consts


@lowers(torch.ops.qcompiler.dequantize_affine.default)
def _qcompiler_dequant(lx: Lowering, n: fx.Node) -> Value:
    codes, scale, zero = (const_of(lx, a, n) for a in n.args[:3])
    assert codes is not None
    assert scale is not None
    group, qmin, qmax = (int(a) for a in n.args[3:6])  # type: ignore[arg-type]
    block = [1] * (codes.dim() - 1) + [group]
    return source_weight(lx, n, "qcompiler.dequantize_affine", (codes, scale, zero, block, qmin, qmax))


@lowers(torch.ops.qcompiler.dequantize_affine_gidx.default)
def _qcompiler_dequant_gidx(lx: Lowering, n: fx.Node) -> Value:
    codes, scale, zero, g_idx = (const_of(lx, a, n) for a in n.args[:4])
    assert codes is not None
    assert scale is not None
    assert g_idx is not None
    group, qmin, qmax = (int(a) for a in n.args[4:7])  # type: ignore[arg-type]
    block = [1] * (codes.dim() - 1) + [group]
    return source_weight(lx, n, "qcompiler.dequantize_affine_gidx", (codes, scale, zero, block, qmin, qmax), g_idx)


@lowers(torch.ops.qcompiler.dequantize_f8e4m3.default)
def _qcompiler_dequant_f8(lx: Lowering, n: fx.Node) -> Value:
    codes, scale = (const_of(lx, a, n) for a in n.args[:2])
    assert codes is not None
    assert scale is not None
    group = int(n.args[2])  # type: ignore[arg-type]
    block = list(codes.shape) if scale.numel() == 1 else [1] * (codes.dim() - 1) + [group]
    return source_weight(lx, n, "qcompiler.dequantize_f8e4m3", (codes, scale, None, block, 0, 255), family="f8e4m3")


def _torchao_dequant(lx: Lowering, n: fx.Node) -> Value:
    codes = const_of(lx, n.args[0], n)
    scale, zero = const_of(lx, n.args[2], n), const_of(lx, n.args[3], n)
    assert codes is not None
    assert scale is not None
    block = [int(b) for b in n.args[1]]  # type: ignore[union-attr]
    qmin = int(n.args[5]) if len(n.args) > 5 and n.args[5] is not None else int(torch.iinfo(codes.dtype).min)  # type: ignore[arg-type]
    qmax = int(n.args[6]) if len(n.args) > 6 and n.args[6] is not None else int(torch.iinfo(codes.dtype).max)  # type: ignore[arg-type]
    return source_weight(lx, n, "torchao.dequantize_affine", (codes, scale, zero, block, qmin, qmax))


def register_optional() -> None:
    """Register lowerings for ops of optional libraries that are loaded now (torchao registers its
    ops when imported, which may happen after this module)."""
    if hasattr(torch.ops, "torchao") and hasattr(torch.ops.torchao, "dequantize_affine"):
        lowers(torch.ops.torchao.dequantize_affine.default)(_torchao_dequant)


register_optional()


@lowers(QD.dequantize_per_channel.default)
def _per_channel(lx: Lowering, n: fx.Node) -> Value:
    codes, scale, zero = (const_of(lx, a, n) for a in n.args[:3])
    assert codes is not None
    assert scale is not None
    axis, qmin, qmax = (int(a) for a in n.args[3:6])  # type: ignore[arg-type]
    block = [1 if i == axis % codes.dim() else s for i, s in enumerate(codes.shape)]
    return source_weight(lx, n, "quantized_decomposed.dequantize_per_channel", (codes, scale, zero, block, qmin, qmax))


def activation_type(lx: Lowering, x: Value, qmin: int, qmax: int) -> QuantType:
    assert isinstance(x.type, DenseType)
    signed, bits = code_type(qmin, qmax, f"activation {x.name}")
    code = code_dtype(f"{'i' if signed else 'u'}{bits}")
    assert code is not None
    ones = tuple(1 for _ in x.type.shape)
    qparams = (("scale", DenseType(DTYPES["f32"], ones)), ("zero", DenseType(code.container, ones)))
    from qcompiler.ir.types import PackSpec

    return QuantType(
        family="affine",
        code=CodeContract(code, Alphabet.range(qmin, qmax)),
        expressed=x.type,
        qparams=qparams,
        pack=PackSpec(tile=tuple(1 for _ in ones)),
        req="activation",
    )


@lowers(QD.quantize_per_tensor.default)
def _quantize_per_tensor(lx: Lowering, n: fx.Node) -> Value:
    x = lx.value(n.args[0])
    scale, zp, qmin, qmax = float(n.args[1]), int(n.args[2]), int(n.args[3]), int(n.args[4])  # type: ignore[arg-type]
    t = activation_type(lx, x, qmin, qmax)
    ones = [1] * len(t.shape)
    zero_dtype = torch.int8 if t.code.dtype.signed else torch.uint8
    bind: dict[str, AttrValue] = {
        "scale": lx.add_tensor(f"{n.name}.scale", torch.full(ones, scale, dtype=torch.float32)),
        "zero": lx.add_tensor(f"{n.name}.zero", torch.full(ones, zp, dtype=zero_dtype)),
    }
    return lx.emit("q.quantize", [x], t, {"bind": bind}, name=n.name)


@lowers(QD.dequantize_per_tensor.default)
def _dequantize_per_tensor(lx: Lowering, n: fx.Node) -> Value:
    src = n.args[0]
    if is_const(lx, src):
        codes = lx.consts[src.name]  # type: ignore[union-attr]
        scale, zero = torch.tensor([float(n.args[1])]), torch.tensor([int(n.args[2])])  # type: ignore[arg-type]
        parts: Args = (codes, scale, zero, list(codes.shape), int(n.args[3]), int(n.args[4]))  # type: ignore[arg-type]
        return source_weight(lx, n, "quantized_decomposed.dequantize_per_tensor", parts)
    q = lx.value(src)
    if not isinstance(q.type, QuantType):
        raise UnsupportedError(f"dequantize_per_tensor of a non-quantized value: {where_from(n)}")
    return lx.emit("q.dequantize", [q], q.type.expressed, name=n.name)


from qcompiler.frontend import mixprec_lowering as _mixprec_lowering  # noqa: E402  (registers its lowering)

del _mixprec_lowering
