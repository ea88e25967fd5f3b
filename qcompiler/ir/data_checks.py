"""Verifier rules that need tensor bytes. Run with ``verify_module(m, data=True)`` /
``qcompiler opt --verify-data``:

- every tensor-table entry's bytes exist, have the right length and match their sha256;
- codes (unpacked through their layout) lie inside the alphabet (the first bad index is named),
  unless the layout's bit fields cannot hold anything else (``Layout.fields_in_range``);
- float qparams (scales, mins, nested super-scales) are finite;
- a permutation is a bijection; exception indices are inside the tensor;
- ``mixprec``: the precision map, each group's code and zero widths, the outliers' CSR, and that
  outliers sit only in 2-bit groups on a code equal to their zero (``mixprec.data_problem``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Iterator, Mapping

import numpy as np

from qcompiler.errors import BlobError, VerifyError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import check_blob, read_array
from qcompiler.ir.core import Module, Op
from qcompiler.ir.layouts import LayoutError, find_layout, unpack_codes
from qcompiler.ir.mixprec import data_problem
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.parallel import ordered_map


class DataChecker:
    """Every tensor's bytes are checked first, one tensor at a time (a weight's codes, the bulk of
    the bytes, when its codes are checked); then each weight's codes and qparams are read and checked,
    weight by weight (memory follows the largest weight)."""

    def __init__(self, m: Module) -> None:
        self.m = m
        self.arrays: dict[str, np.ndarray] = {}

    def read(self, name: str) -> np.ndarray:
        with self.named(name):
            return read_array(self.m, name)

    @contextlib.contextmanager
    def named(self, name: str) -> Generator[None]:
        try:
            yield
        except BlobError as e:
            message = str(e).removeprefix(f"tensor @{name}: ")
            raise VerifyError(message, where=f"tensor @{name}", field="bytes", loc=self.m.tensors[name].loc) from None

    def run(self, jobs: int = 1) -> None:
        """The checks, in ``jobs`` threads (``parallel.ordered_map``, at most ``CHECK_BYTES`` of
        tensors in flight beyond the largest): the first failure in table order, then in op order,
        is raised, whatever the count."""
        codes = {name for op in self.m.ops() if op.name == "q.weight" for name in code_symbols(op.attrs)}
        tensors = [name for name in self.m.tensors if name not in codes]  # codes: read once, by ``weight``

        def blob(name: str) -> None:
            with self.named(name):  # bytes hashed a piece at a time where the location allows
                check_blob(self.m.tensors[name], self.m.base_dir)

        def nbytes(name: str) -> int:
            return self.m.tensors[name].blob.nbytes

        for _ in ordered_map(blob, tensors, jobs, nbytes, CHECK_BYTES):
            pass
        weights = [(op, t) for op in self.m.ops() if op.name == "q.weight" and (t := op.results[0].quant) is not None]

        def weight(item: tuple[Op, QuantType]) -> None:
            DataChecker(self.m).weight(item[0], item[1], item[0].attrs, "")  # its own arrays, per weight

        def codes_bytes(item: tuple[Op, QuantType]) -> int:
            return sum(nbytes(n) for n in code_symbols(item[0].attrs))

        for _ in ordered_map(weight, weights, jobs, codes_bytes, CHECK_BYTES):
            pass

    def array(self, ref: AttrValue) -> np.ndarray:
        assert isinstance(ref, SymbolRef)
        if ref.name not in self.arrays:
            self.arrays[ref.name] = self.read(ref.name)
        return self.arrays[ref.name]

    def weight(self, op: Op, t: QuantType, binding: dict[str, AttrValue], path: str) -> None:
        layout = find_layout(t.pack.family, t.pack.version)
        assert layout is not None  # checked with the descriptor
        needed = {n: self.array(binding[n]) for n in layout.needs}
        if layout.fields_in_range and whole_range(t):
            self.array(binding["codes"])  # bytes checked; every value they can hold is in the alphabet
        else:
            try:
                codes = unpack_codes(layout, self.array(binding["codes"]), t, needed)
            except LayoutError as e:
                raise VerifyError(e.message, where=op.describe(), field=f"{path}{e.part}", loc=op.loc) from None
            check_codes(op, t, codes, f"{path}codes")
            if t.family == "mixprec":
                check_mixprec(op, t, codes, {n: self.array(binding[n]) for n in MIXPREC_STREAMS}, path)
        if t.perm is not None:
            check_perm(op, self.array(binding["perm"]).astype(np.int64), f"{path}perm")
        if "index" in dict(t.exceptions):
            check_exception_index(op, t, self.array(binding["index"]).astype(np.int64), f"{path}index")
        for name, slot in t.qparams:
            value = binding[name]
            if isinstance(slot, QuantType) and isinstance(value, dict):
                self.weight(op, slot, value, f"{path}{name}.")
            elif isinstance(slot, DenseType) and slot.dtype.is_float:
                check_finite(op, self.array(value), slot, f"{path}{name}")


MIXPREC_STREAMS = ("wide", "wide_rows", "col", "rowptr", "zero")


def check_mixprec(op: Op, t: QuantType, codes: np.ndarray, arrays: dict[str, np.ndarray], path: str) -> None:
    """``mixprec``'s cross-stream rules (precision map, widths, CSR, exclusive outliers)."""
    problem = data_problem(t, codes, arrays)
    if problem is not None:
        raise VerifyError(
            problem.message,
            where=op.describe(),
            field=path + problem.field,
            expected=problem.expected,
            found=problem.found,
            loc=op.loc,
        )


def code_symbols(attrs: Mapping[str, object]) -> Iterator[str]:
    """The codes tensor of a binding and of its nested bindings (K-quant scales)."""
    for k, v in attrs.items():
        if isinstance(v, SymbolRef) and k == "codes":
            yield v.name
        elif isinstance(v, Mapping):
            yield from code_symbols(v)  # pyright: ignore[reportUnknownArgumentType]


def whole_range(t: QuantType) -> bool:
    """Whether ``t``'s alphabet is every value of its code dtype (``i4[-8:7]``)."""
    a, d = t.code.alphabet, t.code.dtype
    return a.values is None and a.lo <= d.min and a.hi >= d.max


CHECK_BYTES = 512 << 20
"""Tensor bytes the data checks hold in flight between their threads (a weight larger than this is
checked alone: memory follows the largest weight)."""


def check_data(m: Module, jobs: int = 0) -> None:
    """``DataChecker(m).run`` in ``jobs`` threads (0: every core)."""
    DataChecker(m).run(jobs or os.cpu_count() or 1)


def first_index(mask: np.ndarray) -> str:
    return ",".join(str(int(i)) for i in np.argwhere(mask)[0])


def check_codes(op: Op, t: QuantType, codes: np.ndarray, field: str) -> None:
    """Codes (any integer dtype: compared as they are, never widened, a 128256 x 4096 head's codes
    would be 4.2 GB as int64) inside the alphabet."""
    a = t.code.alphabet
    if a.values is None and (codes.size == 0 or (codes.min() >= a.lo and codes.max() <= a.hi)):
        return
    ok = np.isin(codes, np.array(a.values)) if a.values is not None else (codes >= a.lo) & (codes <= a.hi)
    if ok.all():
        return
    idx = first_index(~ok)
    bad = codes[tuple(int(i) for i in idx.split(","))]
    raise VerifyError(
        "code outside the alphabet",
        where=op.describe(),
        field=f"{field}[{idx}]",
        expected=str(a),
        found=str(int(bad)),
        loc=op.loc,
    )


NONFINITE_BITS: dict[str, tuple[int, int]] = {
    "f8e4m3": (0x7F, 0x7F),  # e4m3fn: no infinities; S.1111.111 is NaN
    "f8e5m2": (0x7C, 0x7C),  # exponent all ones: inf or NaN
}
"""8-bit floats held as raw bytes: a value is non-finite when ``byte & mask == pattern``."""


def nonfinite(arr: np.ndarray, slot: DenseType) -> np.ndarray:
    """Mask of non-finite values of a stored float tensor (bf16 and f8 are held as raw integers)."""
    name = slot.dtype.name
    if name in NONFINITE_BITS:
        mask, pattern = NONFINITE_BITS[name]
        return (arr.astype(np.uint8) & mask) == pattern
    if name == "bf16":
        return ~np.isfinite((arr.astype(np.uint32) << 16).view(np.float32))
    return ~np.isfinite(arr)


def describe_value(raw: np.generic, slot: DenseType) -> str:
    if slot.dtype.name == "bf16":
        return str(np.array([raw], np.uint32).__lshift__(16).view(np.float32)[0])
    if slot.dtype.name in NONFINITE_BITS:
        return f"raw byte 0x{int(raw):02x} (not finite in {slot.dtype.name})"
    return str(raw)


def check_finite(op: Op, arr: np.ndarray, slot: DenseType, field: str) -> None:
    bad = nonfinite(arr, slot)
    if bad.any():
        idx = first_index(bad)
        raise VerifyError(
            "qparam holds a non-finite value",
            where=op.describe(),
            field=f"{field}[{idx}]",
            expected="finite",
            found=describe_value(arr[tuple(int(i) for i in idx.split(","))], slot),
            loc=op.loc,
        )


def check_perm(op: Op, perm: np.ndarray, field: str) -> None:
    if np.array_equal(np.sort(perm), np.arange(perm.size)):
        return
    raise VerifyError(
        "permutation is not a bijection",
        where=op.describe(),
        field=field,
        expected=f"each of 0..{perm.size - 1} exactly once",
        found=first_non_bijective(perm),
        loc=op.loc,
    )


def check_exception_index(op: Op, t: QuantType, index: np.ndarray, field: str) -> None:
    numel = t.expressed.numel() or 0
    bad = (index < 0) | (index >= numel)
    if bad.any():
        i = int(np.argwhere(bad)[0][0])
        raise VerifyError(
            "exception index outside the tensor",
            where=op.describe(),
            field=f"{field}[{i}]",
            expected=f"in [0, {numel - 1}]",
            found=str(int(index[i])),
            loc=op.loc,
        )
    if np.any(np.diff(index) <= 0):
        i = int(np.argwhere(np.diff(index) <= 0)[0][0]) + 1
        raise VerifyError(
            "exception indices must be strictly increasing",
            where=op.describe(),
            field=f"{field}[{i}]",
            expected=f"> {int(index[i - 1])}",
            found=str(int(index[i])),
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
