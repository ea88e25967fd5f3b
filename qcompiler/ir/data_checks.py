"""Verifier rules that need tensor bytes: hashes, codes inside the alphabet, permutations that are
bijections. Run with ``verify_module(m, data=True)`` / ``qcompiler opt --verify-data``."""

from __future__ import annotations

import numpy as np

from qcompiler.errors import BlobError, VerifyError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_array
from qcompiler.ir.core import Module, Op
from qcompiler.ir.types import QuantType


def check_data(m: Module) -> None:
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is not None:
            check_weight_data(m, op, t, op.attrs)


def load(m: Module, op: Op, ref: AttrValue, field: str) -> np.ndarray:
    assert isinstance(ref, SymbolRef)
    try:
        return read_array(m, ref.name)
    except BlobError as e:
        raise VerifyError(str(e), where=op.describe(), field=field, loc=op.loc) from None


def check_weight_data(m: Module, op: Op, t: QuantType, binding: dict[str, AttrValue], path: str = "") -> None:
    if t.pack.family == "logical":
        codes = load(m, op, binding["codes"], f"{path}codes").astype(np.int64)
        check_codes(op, t, codes, f"{path}codes")
    if t.perm is not None:
        perm = load(m, op, binding["perm"], f"{path}perm").astype(np.int64)
        if not np.array_equal(np.sort(perm), np.arange(perm.size)):
            bad = first_non_bijective(perm)
            raise VerifyError(
                "permutation is not a bijection",
                where=op.describe(),
                field=f"{path}perm",
                expected=f"each of 0..{perm.size - 1} exactly once",
                found=bad,
                loc=op.loc,
            )
    for name, slot in t.qparams:
        value = binding[name]
        if isinstance(slot, QuantType) and isinstance(value, dict):
            check_weight_data(m, op, slot, value, f"{path}{name}.")


def check_codes(op: Op, t: QuantType, codes: np.ndarray, field: str) -> None:
    a = t.code.alphabet
    ok = np.isin(codes, np.array(a.values)) if a.values is not None else (codes >= a.lo) & (codes <= a.hi)
    if ok.all():
        return
    idx = tuple(int(i) for i in np.argwhere(~ok)[0])
    raise VerifyError(
        "code outside the alphabet",
        where=op.describe(),
        field=f"{field}[{','.join(map(str, idx))}]",
        expected=str(a),
        found=str(int(codes[idx])),
        loc=op.loc,
    )


def first_non_bijective(perm: np.ndarray) -> str:
    seen: dict[int, int] = {}
    for i, v in enumerate(perm.tolist()):
        if not 0 <= v < perm.size:
            return f"perm[{i}] = {v} out of range"
        if v in seen:
            return f"perm[{seen[v]}] = perm[{i}] = {v}"
        seen[v] = i
    return "a value is missing"
