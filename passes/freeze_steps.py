"""The steps of ``freeze-semantics`` (kept apart so the pass file stays a thin driver)."""

from __future__ import annotations

from importlib import metadata

import numpy as np

from qcompiler.errors import PassError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_array, read_float32
from qcompiler.ir.core import Module, Op, narrow
from qcompiler.ir.ops.quant import Quantize, SourceWeight
from qcompiler.ir.ops.shapes import dense
from qcompiler.ir.rewrite import replace_uses
from qcompiler.passes.freeze_known import EvidenceFor, Proven, bind_weight, check_scheme
from qcompiler.passes.freeze_proof import Affine, prove_exact, prove_source_rows
from qcompiler.proofs import DecodeFact
from qcompiler.quant.describe import describe

__all__ = [
    "Proven",
    "bind_weight",
    "freeze_weight",
    "prove_weight",
    "provenance",
    "refuse_invented_codes",
    "replace_uses",
]


def array(m: Module, op: Op, key: str) -> np.ndarray | None:
    ref = op.attrs.get(key)
    return read_array(m, ref.name) if isinstance(ref, SymbolRef) else None


def freeze_weight(m: Module, op: Op, req: str, scheme: str) -> Op:
    """Build the descriptor for one ``q.source_weight``, prove decode == effective, emit ``q.weight``."""
    return bind_weight(m, op, prove_weight(m, op, req, scheme))


def prove_weight(m: Module, op: Op, req: str, scheme: str, evidence: EvidenceFor | None = None) -> Proven:
    """The descriptor of one ``q.source_weight``, its decode proven equal to the effective weight
    (and the weight checked against ``scheme``); reads the module, changes nothing (safe in threads).
    With ``evidence``, the decode's digest and rung 3's errors are computed from the decode the
    proof holds (``qcompiler.proofs``)."""
    w = narrow(op, SourceWeight)
    name = w.codes.name.removesuffix(".codes")
    where = f"tensor @{name}"
    codes, scale = array(m, op, "codes"), array(m, op, "scale")
    assert codes is not None
    assert scale is not None
    block = [int(b) for b in w.block]  # type: ignore[arg-type]
    qmin, qmax = w.qmin, w.qmax
    zero, g_idx = array(m, op, "zero"), array(m, op, "g_idx")
    effective_ref = w.effective
    scale_dtype = m.tensors[w.scale.name].blob.dtype.name
    family = w.family or "affine"
    d = describe(where, codes, scale, zero, block, qmin, qmax, dense(op.result), req, g_idx, scale_dtype, family)
    ev = evidence(name, d.type) if evidence is not None else None
    if effective_ref is not None:
        prove_exact(where, d.type, d.arrays, read_float32(m, effective_ref.name), ev)
    else:
        prove_source_rows(where, d, Affine(codes, scale, zero, block[-1], qmin, qmax), ev)
    if scheme:
        check_scheme(where, d.arrays, d.type, scheme)
    return Proven(name, d.type, d.arrays, {}, None if ev is None else DecodeFact(ev.digest(), ev.rung3()))


def refuse_invented_codes(m: Module) -> None:
    for g in m.graphs:
        made_by = {id(r): op for op in g.ops for r in op.results}
        for op in g.ops:
            src = made_by.get(id(op.x)) if isinstance(op, Quantize) else None
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
