"""What ``freeze-semantics`` records and reuses beside its proofs: the decode evidence a proof feeds
(``evidence_for``), a weight the stream froze ahead (``frozen_ahead``, ``passes/ahead.py``), and the
binding of a frozen weight, proven here or ahead, into the module."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import bind, store
from qcompiler.ir.core import BlobRef, Module, Op, create_op, narrow
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.ops.quant import SourceWeight
from qcompiler.ir.ops.shapes import dense
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.parity import rung3_input
from qcompiler.parity_rows import DecodeEvidence, row_reader
from qcompiler.proofs import DecodeFact, Proofs
from qcompiler.quant.describe import FreezeError, numpy_dtype_name
from qcompiler.quant.schemes import parse_scheme

EvidenceFor = Callable[[str, QuantType], "DecodeEvidence | None"]
"""Weight name and descriptor -> where the proof's decode also goes (its digest and rung 3), if anywhere."""


@dataclass(frozen=True)
class Proven:
    """One source weight frozen: its descriptor, the arrays to store (proven here) or the references
    already stored (frozen ahead by the stream, ``passes/ahead.py``), and its decode's facts."""

    name: str
    type: QuantType
    arrays: dict[str, np.ndarray] = field(default_factory=dict[str, np.ndarray])
    refs: dict[str, BlobRef] = field(default_factory=dict[str, BlobRef])
    fact: DecodeFact | None = None


FrozenKey = tuple[object, ...]


def frozen_key(
    name: str,
    tensors: Mapping[str, str],
    block: list[int],
    qmin: int,
    qmax: int,
    expressed: DenseType,
    req: str,
    scale_dtype: str,
) -> FrozenKey:
    """What ``freeze-semantics`` proves about one ``q.source_weight`` depends on: its name, the sha256
    of each bound tensor (codes, scale, zero, g_idx, and the effective weight a pre-quantized layer's
    decode must equal), its attributes, result type and consumer."""
    return (name, tuple(sorted(tensors.items())), tuple(block), qmin, qmax, str(expressed), req, scale_dtype)


def part_dtype(t: QuantType, part: str, arr: np.ndarray) -> Any:
    """The IR dtype ``freeze-semantics`` stores a described array in: its slot's, else its own."""
    slot = dict(t.qparams).get(part)
    return slot.dtype if isinstance(slot, DenseType) else DTYPES[numpy_dtype_name(arr)]


def frozen_ahead(
    m: Module, op: Op, req: str, proofs: Proofs, check: Callable[[str, Collection[str], QuantType], None]
) -> Proven | None:
    """The weight as the stream froze it ahead (``passes/ahead.py``) from exactly this op's inputs
    (tensor sha256s, attributes, result type, consumer), or ``None``: then ``prove_weight``."""
    w = narrow(op, SourceWeight)
    codes_ref, scale_ref = w.codes, w.scale
    name = codes_ref.name.removesuffix(".codes")
    tensors: dict[str, str] = {}
    for slot in ("codes", "scale", "zero", "g_idx", "effective"):
        ref = op.attrs.get(slot)
        if isinstance(ref, SymbolRef):
            tensors[slot] = m.tensors[ref.name].blob.sha256
    block = [int(b) for b in w.block]  # type: ignore[arg-type]
    qmin, qmax = w.qmin, w.qmax
    scale_dtype = m.tensors[scale_ref.name].blob.dtype.name
    known = proofs.frozen(frozen_key(name, tensors, block, qmin, qmax, dense(op.result), req, scale_dtype))
    if known is None:
        return None
    check(f"tensor @{name}", known.parts, known.type)
    return Proven(name, known.type, {}, dict(known.parts), known.fact)


def bind_weight(m: Module, op: Op, proven: Proven) -> Op:
    """Store a proven weight's arrays (or bind its stored references) in ``m``; its ``q.weight`` op."""
    binding: dict[str, AttrValue] = {}
    for part, arr in proven.arrays.items():
        store(m, f"{proven.name}.{part}", arr, part_dtype(proven.type, part, arr))
        binding[part] = SymbolRef(f"{proven.name}.{part}")
    for part, ref in proven.refs.items():
        bind(m, f"{proven.name}.{part}", ref)
        binding[part] = SymbolRef(f"{proven.name}.{part}")
    weight = create_op("q.weight", [], [proven.type], binding, [op.result.name])
    weight.comments = op.comments
    return weight


def evidence_for(float_weights: Mapping[str, Any]) -> EvidenceFor:
    """Each proof's ``DecodeEvidence``: rung 3's seeded input for a linear's 2-D weight, and the
    weight's float rows for its quantization error."""

    def make(name: str, t: QuantType) -> DecodeEvidence:
        x = rung3_input(name, int(t.shape[1])) if t.req == "linear" and t.rank == 2 else None
        return DecodeEvidence(x, int(t.shape[0]) if t.rank else 0, row_reader(float_weights, name))

    return make


def checker(scheme: str) -> Callable[[str, Collection[str], QuantType], None]:
    """``check_scheme`` against ``scheme`` (nothing without one) for a weight frozen ahead."""
    return lambda where, parts, t: check_scheme(where, parts, t, scheme) if scheme else None


def check_scheme(where: str, arrays: Collection[str], t: QuantType, scheme: str) -> None:
    """The weight must be what ``scheme`` makes: same bits, same (effective) group size along K,
    same symmetry. A group at least as long as K is one group per row, like per-channel."""
    s = parse_scheme(scheme)
    k = int(t.shape[-1])
    found_size = t.group.size if t.group is not None and t.group.axis == t.rank - 1 else None
    want_size = k if s.group is None else min(s.group, k)
    symmetric = "zero" not in arrays
    if t.code.dtype.bits != s.bits or found_size != want_size or symmetric != s.symmetric:
        group = "per-tensor" if found_size is None else ("channel" if found_size == k else f"g{found_size}")
        found = f"w{t.code.dtype.bits}-{group}{'' if symmetric else '-asym'}"
        raise FreezeError(f"{where}: quantized as {found}, but the declared scheme is {s.name}")
