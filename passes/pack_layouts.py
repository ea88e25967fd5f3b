"""``pack-layouts``: store every quantized weight in the target's layout, proving ``unpack(pack(Q)) == Q``.

The target's backend ``plan``s each weight still in the ``logical`` layout. An exact plan repacks
the codes (compressed-tensors: offset-binary, LSB-first int32 words; a layout that ``needs`` slots,
``mixprec``'s planes, reads them from the binding) and proves the unpack gives back every code; the
descriptor's ``pack`` changes, nothing else does. A refinement (``refine.py``: the descriptor rewritten,
codes and decode kept) runs and is recorded; a conversion (``conversions.py``) is refused, naming the
weight and what the target lacks, unless ``allow-conversion``; then it runs, its error measured. Both
go into the module's ``conversions`` attribute. One walk of each graph (``apply``) plans the weights
in program order; the packing follows.

Before::

    %w = q.weight() {codes = @w.codes, scale = @w.scale} : !q.affine<i4[-8:7] -> f32[64,64], ...,
         pack=(family=logical, version=1, encoding=none, tile=[1,1]), ...>

After (``pack-layouts{target=safetensors}``): ``@w.codes`` is ``i32[64,8]`` and the type says
``pack=(family=ct-pack-quantized, version=1, encoding=offset-binary-lsb, tile=[1,1])``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from qcompiler.backends import get_backend
from qcompiler.errors import PassError
from qcompiler.ir import layouts, row_blocks
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.blobs import bind, put_array, read_array
from qcompiler.ir.core import BlobRef, Module, Op
from qcompiler.ir.layouts import Layout, find_layout
from qcompiler.ir.module_attrs import conversions, model_dtype, source_formats
from qcompiler.ir.ops.quant import weight_name
from qcompiler.ir.rewrite import Rewriter, apply
from qcompiler.ir.types import PackSpec, QuantType
from qcompiler.parallel import ordered_map
from qcompiler.passes.base import Pass, PassContext, module_target
from qcompiler.passes.conversions import DENSE_USES, refused
from qcompiler.passes.refine import REWRITES
from qcompiler.proofs import key_of, packed_key

Slots = Mapping[str, np.ndarray] | None
ROUND_TRIP_ELEMENTS = 1 << 20  # codes unpacked and compared at a time (a few MB, whatever the weight)


def pack_exact(m: Module, op: Op, t: QuantType, pack: PackSpec, name: str) -> tuple[BlobRef, QuantType]:
    """``pack_codes`` of one weight's codes; the module is not changed (safe in threads: ``commit`` binds it)."""
    ref, layout = op.attrs["codes"], find_layout(pack.family, pack.version)
    assert isinstance(ref, SymbolRef)
    assert layout is not None
    slots = {n: read_array(m, r.name) for n in layout.needs if isinstance(r := op.attrs.get(n), SymbolRef)}
    return pack_codes(layout, read_array(m, ref.name), t, pack, name, slots)


def pack_codes(
    layout: type[Layout], codes: np.ndarray, t: QuantType, pack: PackSpec, name: str, slots: Slots = None
) -> tuple[BlobRef, QuantType]:
    """``codes`` packed by ``layout`` (given the ``slots`` it needs), the round trip and physical shape proven."""
    new_t = dataclasses.replace(t, pack=pack)
    blob = layouts.pack_codes(layout, codes, new_t, slots)
    if not round_trips(layout, blob, codes, new_t, slots):
        raise PassError(f"{name}: unpack(pack(Q)) != Q for layout {pack.family} v{pack.version}; not packed")
    dtype, shape = layout.physical(new_t)
    if tuple(blob.shape) != shape:
        raise PassError(f"{name}: layout {pack.family} gave shape {list(blob.shape)}, it declares {list(shape)}")
    return put_array(blob, dtype), new_t


def round_trips(layout: type[Layout], blob: np.ndarray, codes: np.ndarray, t: QuantType, slots: Slots = None) -> bool:
    """``unpack(blob) == codes``, a block of rows at a time where the layout slices by rows (and needs no slots)."""
    if layout.needs or not row_blocks.sliceable(t) or codes.ndim != 2:
        return bool(np.array_equal(layouts.unpack_codes(layout, blob, t, slots), codes))
    for r0, r1 in row_blocks.blocks(t, ROUND_TRIP_ELEMENTS):
        rows = row_blocks.slice_codes(blob, t, r0, r1)
        if not np.array_equal(layout.unpack(rows, row_blocks.slice_type(t, r0, r1)), codes[r0:r1]):
            return False
    return True


def commit(m: Module, op: Op, packed: tuple[BlobRef, QuantType]) -> None:
    ref = op.attrs["codes"]
    assert isinstance(ref, SymbolRef)
    bind(m, ref.name, packed[0])
    op.results[0].type = packed[1]


@dataclass(frozen=True)
class PackLayoutsPass(Pass):
    """Choose and prove physical layouts for the target (see the module docstring)."""

    name: ClassVar[str] = "pack-layouts"
    summary: ClassVar[str] = "pack codes into the target's layout, proving unpack(pack(Q)) == Q"
    requires: ClassVar[frozenset[str]] = frozenset({"shards-placed"})
    establishes: ClassVar[frozenset[str]] = frozenset({"layouts-packed"})
    target: str = ""
    """backend whose layouts to choose (default: the one place-shards planned for)"""
    allow_conversion: bool = False
    """allow changes to codes/groups/qparams (measured and recorded)"""

    def run(self, module: Module, ctx: PassContext) -> Module:
        target = self.target or module_target(module)
        backend = get_backend(target)
        records, prefer, dtype = conversions(module), source_formats(module), model_dtype(module)
        todo: list[tuple[Op, QuantType, PackSpec, str]] = []

        def plan_weight(rw: Rewriter, op: Op) -> bool:
            t = op.results[0].quant if op.name == "q.weight" else None
            if t is None or t.pack.family != "logical":
                return False
            plan = backend.plan(name := weight_name(op), t, prefer.get(name, ""), dtype)
            while plan.kind != "exact":  # a refinement (lossless) or a conversion, then plan again
                if plan.kind == "conversion" and not self.allow_conversion:
                    raise refused(name, target, plan.reason)
                record = REWRITES[plan.convert](module, rw, op, t, name, plan.to)
                if record.get("lossless") is False and not self.allow_conversion:
                    raise refused(name, target, f"{plan.reason}; here it would move the decode")
                records.append({"tensor": name, "reason": plan.reason, **record})
                ctx.count(f"pack-layouts.{plan.kind}-{plan.convert}")
                if plan.convert == "dense":
                    return True
                t = op.results[0].quant
                assert t is not None
                plan = backend.plan(name, t, prefer.get(name, ""), dtype)
            assert plan.pack is not None
            todo.append((op, t, plan.pack, name))
            return False  # packed below, once every weight is planned

        for g in module.graphs:
            apply(g, [plan_weight, *DENSE_USES])
        proofs = ctx.artifact.proofs if ctx.artifact is not None else None  # checked in threads, bound in op order

        def pack(w: tuple[Op, QuantType, PackSpec, str]) -> tuple[BlobRef, QuantType]:
            op, t, spec, name = w
            known = None if proofs is None else proofs.packed_as(packed_key(key_of(module, name, op, t), spec))
            return known if known is not None else pack_exact(module, *w)  # packed ahead by the stream, or here

        for (op, t, _, name), packed in zip(todo, ordered_map(pack, todo, ctx.jobs), strict=True):
            logical = key_of(module, name, op, t) if proofs is not None else None
            commit(module, op, packed)
            if proofs is not None:  # unpack(pack(Q)) == Q: the packed weight decodes as the logical one
                proofs.alias(key_of(module, name, op, packed[1]), logical)
            ctx.count("pack-layouts.packed")
        if records:
            module.attrs["conversions"] = records
        return module
