"""The steps of ``freeze-semantics`` (kept apart so the pass file stays a thin driver)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

import numpy as np

from qcompiler.errors import PassError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_array, read_float32, store
from qcompiler.ir.core import Module, Op, create_op
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.ops.shapes import dense
from qcompiler.ir.rewrite import replace_uses
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.parity_rows import DecodeEvidence
from qcompiler.passes.freeze_proof import Affine, prove_exact, prove_source_rows
from qcompiler.proofs import DecodeFact
from qcompiler.quant.describe import Described, FreezeError, describe, numpy_dtype_name
from qcompiler.quant.schemes import parse_scheme

__all__ = ["bind_weight", "freeze_weight", "prove_weight", "provenance", "refuse_invented_codes", "replace_uses"]


def array(m: Module, op: Op, key: str) -> np.ndarray | None:
    ref = op.attrs.get(key)
    return read_array(m, ref.name) if isinstance(ref, SymbolRef) else None


EvidenceFor = Callable[[str, QuantType], "DecodeEvidence | None"]
"""Weight name and descriptor -> where the proof's decode also goes (its sha256 and rung 3), if anywhere."""


def freeze_weight(m: Module, op: Op, req: str, scheme: str) -> Op:
    """Build the descriptor for one ``q.source_weight``, prove decode == effective, emit ``q.weight``."""
    name, d, _ = prove_weight(m, op, req, scheme)
    return bind_weight(m, op, name, d)


def prove_weight(
    m: Module, op: Op, req: str, scheme: str, evidence: EvidenceFor | None = None
) -> tuple[str, Described, DecodeFact | None]:
    """The descriptor of one ``q.source_weight``, its decode proven equal to the effective weight
    (and the weight checked against ``scheme``); reads the module, changes nothing (safe in threads).
    With ``evidence``, the decode's sha256 and rung 3's errors are computed from the decode the
    proof holds (``qcompiler.proofs``)."""
    codes_ref = op.attrs["codes"]
    assert isinstance(codes_ref, SymbolRef)
    name = codes_ref.name.removesuffix(".codes")
    where = f"tensor @{name}"
    codes, scale = array(m, op, "codes"), array(m, op, "scale")
    assert codes is not None
    assert scale is not None
    block = [int(b) for b in op.attrs["block"]]  # type: ignore[union-attr]
    qmin, qmax = int(op.attrs["qmin"]), int(op.attrs["qmax"])  # type: ignore[arg-type]
    zero, g_idx = array(m, op, "zero"), array(m, op, "g_idx")
    effective_ref = op.attrs.get("effective")
    scale_ref = op.attrs["scale"]
    assert isinstance(scale_ref, SymbolRef)
    scale_dtype = m.tensors[scale_ref.name].blob.dtype.name
    d = describe(where, codes, scale, zero, block, qmin, qmax, dense(op.result), req, g_idx, scale_dtype)
    ev = evidence(name, d.type) if evidence is not None else None
    if isinstance(effective_ref, SymbolRef):
        prove_exact(where, d.type, d.arrays, read_float32(m, effective_ref.name), ev)
    else:
        prove_source_rows(where, d, Affine(codes, scale, zero, block[-1], qmin, qmax), ev)
    if scheme:
        check_scheme(where, d.arrays, d.type, scheme)
    return name, d, None if ev is None else DecodeFact(ev.digest(), ev.rung3())


def bind_weight(m: Module, op: Op, name: str, d: Described) -> Op:
    """Store a proven weight's arrays in ``m`` and return its ``q.weight`` op."""
    binding: dict[str, AttrValue] = {}
    slots = dict(d.type.qparams)
    for part, arr in d.arrays.items():
        key = f"{name}.{part}"
        slot = slots.get(part)
        dtype = slot.dtype if isinstance(slot, DenseType) else DTYPES[numpy_dtype_name(arr)]
        store(m, key, arr, dtype)
        binding[part] = SymbolRef(key)
    weight = create_op("q.weight", [], [d.type], binding, [op.result.name])
    weight.comments = op.comments
    return weight


def check_scheme(where: str, arrays: dict[str, np.ndarray], t: QuantType, scheme: str) -> None:
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


def refuse_invented_codes(m: Module) -> None:
    for g in m.graphs:
        made_by = {id(r): op for op in g.ops for r in op.results}
        for op in g.ops:
            src = made_by.get(id(op.operands[0])) if op.name == "q.quantize" else None
            if src is not None and src.name == "const":
                raise PassError(
                    f"freeze-semantics refuses {op.describe()}: it would invent codes for the float constant "
                    f"{src.attrs.get('ref')}; quantize the model (e.g. --scheme) before capture instead"
                )


def provenance(kinds: list[str], scheme: str) -> dict[str, AttrValue]:
    versions: dict[str, AttrValue] = {}
    for pkg in ("torch", "torchao", "transformers", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    out: dict[str, AttrValue] = {
        "sources": list[AttrValue](kinds),
        "libraries": versions,
        "frozen_by": "freeze-semantics",
    }
    if scheme:
        out["scheme"] = scheme
    return out
