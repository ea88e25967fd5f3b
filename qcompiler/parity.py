"""The parity ladder, rungs 1-3.

1. pack/unpack: each weight's codes survive its layout, ``unpack(pack(Q)) == Q``;
2. reference reconstruction: the reference decode of every weight equals, bit for bit, the weights
   the model used before export (its effective, dequantized weights);
3. operator: for every quantized linear, ``E_kernel = ||Y_k - Y_ref||`` (the kernel against the
   reference decode) is reported apart from ``E_quant = ||Y_ref - Y_fp||`` (the reference decode
   against the float weights), computed in float64; non-finite values are rejected.

Each rung returns ``RungResult`` rows; ``ok`` is false on any failure and ``detail`` says where.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from qcompiler.errors import QcError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_array
from qcompiler.ir.core import Module, Op
from qcompiler.ir.layouts import find_layout, logical_view, pack_codes, unpack_codes
from qcompiler.ir.ops.quant import weight_name
from qcompiler.ir.reference import decode
from qcompiler.ir.types import PackSpec, QuantType


class ParityError(QcError):
    """Inputs to a parity check that cannot give a meaningful number (non-finite, shape mismatch)."""


@dataclass(frozen=True)
class RungResult:
    rung: int
    tensor: str
    ok: bool
    detail: str = ""
    metrics: dict[str, float] = field(default_factory=dict[str, float])


def weights(m: Module) -> list[tuple[str, Op, QuantType]]:
    """``(name, q.weight op, descriptor)`` for every quantized weight; the name drops ``.codes``."""
    out: list[tuple[str, Op, QuantType]] = []
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is not None:
            out.append((weight_name(op), op, t))
    return out


def parts(m: Module, binding: Mapping[str, AttrValue]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in binding.items():
        out[k] = parts(m, v) if isinstance(v, dict) else read_array(m, v.name) if isinstance(v, SymbolRef) else v
    return out


def decoded(m: Module, op: Op, t: QuantType, logical: np.ndarray | None = None) -> np.ndarray:
    """The reference decode of one ``q.weight`` (codes unpacked from their layout first, unless
    ``logical``, the codes already unpacked, is given)."""
    p = parts(m, op.attrs)
    codes = p["codes"]
    assert isinstance(codes, np.ndarray)
    if logical is None:
        p["codes"], lt = logical_view(codes, t, p)
    else:
        p["codes"], lt = logical, dataclasses.replace(t, pack=PackSpec())
    return np.asarray(decode(lt, p), dtype=np.float32)  # type: ignore[arg-type]


def pack_round_trip(
    codes: np.ndarray, t: QuantType, slots: Mapping[str, object] | None = None
) -> tuple[bool, np.ndarray]:
    """Rung 1 for one weight's stored codes ``P``: ``Q = unpack(P)``, then ``unpack(pack(Q)) == Q``;
    returns the verdict and ``Q`` (the logical codes the decode reads). When ``pack(Q)`` is ``P``
    byte for byte, ``unpack(pack(Q))`` is ``unpack(P) = Q`` without unpacking again. ``slots``: the
    weight's other arrays, for a layout that ``needs`` some (``mixprec``'s precision map)."""
    layout = find_layout(t.pack.family, t.pack.version)
    if layout is None:
        raise TypeError(f"unknown layout {t.pack.family} v{t.pack.version}")
    logical = unpack_codes(layout, codes, t, slots)
    again = pack_codes(layout, logical, t, slots)
    if again.dtype == codes.dtype and again.shape == codes.shape and np.array_equal(again, codes):
        return True, logical
    return bool(np.array_equal(unpack_codes(layout, again, t, slots), logical)), logical


def needed_parts(m: Module, op: Op, t: QuantType) -> dict[str, object]:
    """The codes of one ``q.weight`` and the slots its layout ``needs`` (read from its binding)."""
    layout = find_layout(t.pack.family, t.pack.version)
    names = ("codes", *(layout.needs if layout is not None else ()))
    return parts(m, {n: op.attrs[n] for n in names if n in op.attrs})


def rung1_pack_unpack(m: Module) -> list[RungResult]:
    rows: list[RungResult] = []
    for name, op, t in weights(m):
        p = needed_parts(m, op, t)
        codes = p["codes"]
        assert isinstance(codes, np.ndarray)
        rows.append(rung1_row(name, t, pack_round_trip(codes, t, p)[0]))
    return rows


def rung1_row(name: str, t: QuantType, ok: bool) -> RungResult:
    return RungResult(1, name, ok, "" if ok else f"unpack(pack(Q)) != Q for layout {t.pack.family} v{t.pack.version}")


def decoded_weights(m: Module) -> dict[str, np.ndarray]:
    """The reference decode of every quantized weight, by name (decode once, share among rungs)."""
    return {name: decoded(m, op, t) for name, op, t in weights(m)}


def rung2_reconstruction(
    m: Module, effective: Mapping[str, torch.Tensor | np.ndarray], decodes: Mapping[str, np.ndarray] | None = None
) -> list[RungResult]:
    """Compare each weight's reference decode with ``effective[name]`` (the pre-export weights)."""
    rows: list[RungResult] = []
    for name, op, t in weights(m):
        want = effective.get(name)
        if want is None:
            rows.append(RungResult(2, name, False, "no pre-export weight given for this tensor"))
            continue
        ref = np.asarray(want.detach().float().numpy() if isinstance(want, torch.Tensor) else want, dtype=np.float32)
        got = decodes[name] if decodes is not None else decoded(m, op, t)
        same = ref.shape == got.shape and bool(np.array_equal(ref.view(np.uint32), got.view(np.uint32)))
        detail = "" if same else first_difference(ref, got)
        rows.append(RungResult(2, name, same, detail, {"max_abs_diff": 0.0 if same else max_abs(ref, got)}))
    return rows


def first_difference(a: np.ndarray, b: np.ndarray, row0: int = 0) -> str:
    """Where ``b`` first differs from ``a`` bit for bit (``row0``: the rows are a block from there)."""
    if a.shape != b.shape:
        return f"shape differs: expected {list(a.shape)}, found {list(b.shape)}"
    idx = tuple(int(i) for i in np.argwhere(a.view(np.uint32) != b.view(np.uint32))[0])
    at = [idx[0] + row0, *idx[1:]] if idx else []
    return f"first difference at {at}: expected {a[idx]!r}, found {b[idx]!r}"


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.shape == b.shape and a.size else 0.0


@dataclass(frozen=True)
class OperatorParity:
    """Errors of one quantized linear on one input batch (float64 norms)."""

    e_kernel: float
    e_quant: float | None
    rel_kernel: float
    rel_quant: float | None


Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(x, decoded weight as float32) -> y``; the default is torch's float32 ``F.linear``."""


def finite(name: str, x: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(x).all()):
        raise ParityError(f"{name} holds non-finite values; parity norms would be meaningless")
    return x


PRODUCT_BYTES = 1 << 20
"""float64 weight rows ``product`` widens at a time: the block stays in the core's cache while it is
multiplied (a 1M-element weight: 0.47 ms here, against 1.07 ms for 256-row blocks multiplied by
``torch.mm``, whose float64 path went through memory)."""


def product(x64: torch.Tensor, w: torch.Tensor, what: str, scanned: bool) -> torch.Tensor:
    """``x64 @ w.T`` in float64 (``w`` of any float dtype, widened exactly a block of rows at a
    time). Unless ``scanned`` (``w`` was checked finite already), a non-finite output is blamed on
    ``w``: with every ``x`` finite and non-zero, an infinite or NaN weight makes its output column
    non-finite, and finite float32 operands cannot overflow float64, so checking the few output
    values proves the whole weight finite."""
    n, k = int(w.shape[0]), int(w.shape[1])
    step = max(1, PRODUCT_BYTES // max(8 * k, 1))
    xt = np.ascontiguousarray(x64.numpy().T)
    y = np.empty((n, int(x64.shape[0])), dtype=np.float64)
    buf = np.empty((min(step, n), k), dtype=np.float64)
    rows = as_numpy_float(w)
    for i in range(0, n, step):
        j = min(n, i + step)
        widen(buf[: j - i], rows[i:j])
        np.dot(buf[: j - i], xt, out=y[i:j])
    out = torch.from_numpy(y).T
    if not scanned and not bool(torch.isfinite(out).all()):
        raise ParityError(f"{what} holds non-finite values; parity norms would be meaningless")
    return out


def as_numpy_float(w: torch.Tensor) -> np.ndarray:
    """``w``'s values as numpy, without a copy: float32/float16/float64 as they are, bfloat16 as its
    raw ``uint16`` bits (``widen`` makes them float)."""
    t = w.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def widen(out: np.ndarray, rows: np.ndarray) -> None:
    """``out[...] = rows`` in float64, exactly (``rows`` from ``as_numpy_float``: bfloat16 bits are
    the high half of a float32). float32 through numpy, not torch: a torch copy of a few hundred KB
    runs on the intra-op pool, whose threads cost more than the copy when two workers each start
    them. bfloat16 through torch where the pool is one thread (the compile's workers:
    ``parallel.kernel_threads``): one pass, where numpy takes two (14 against 34 us a 64 x 2048 block)."""
    if rows.dtype != np.uint16:
        np.copyto(out, rows)
    elif torch.get_num_threads() == 1 and rows.flags.writeable and out.flags.c_contiguous:
        torch.from_numpy(out).copy_(torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16))
    else:
        np.copyto(out, (rows.astype(np.uint32) << 16).view(np.float32))


def rung3_input(name: str, k: int, rows: int = 4, seed: int = 0) -> torch.Tensor:
    """Rung 3's seeded random input for weight ``name`` with ``k`` input features: drawn from the
    name and ``seed`` alone, so any step that holds the weight (the ladder, ``freeze-semantics``'
    proof) computes the same operator errors for it, in any order."""
    gen = torch.Generator().manual_seed(seed * 0x1_0000_0000 + zlib.crc32(name.encode()))
    return torch.randn(rows, k, generator=gen)


def operator_parity(
    x: torch.Tensor, w_decoded: np.ndarray, w_float: torch.Tensor | None, kernel: Kernel | None = None
) -> OperatorParity:
    """Kernel error (kernel vs reference decode) apart from quantization error (decode vs float)."""
    wq = torch.from_numpy(np.ascontiguousarray(w_decoded))
    finite("input", x)
    scan = not bool((x != 0).all())  # a zero input cannot reveal a non-finite weight: check it whole
    if scan:
        finite("decoded weight", wq)
    x64 = x.double()
    y_ref = product(x64, wq, "decoded weight", scan)
    y_k = finite("kernel output", (kernel or torch.nn.functional.linear)(x.float(), wq.float())).double()
    y_fp = None
    if w_float is not None:
        wf = w_float.detach()
        if scan:
            finite("float weight", wf)
        y_fp = product(x64, wf, "float weight", scan)
    return norms(y_ref, y_k, y_fp)


def norms(y_ref: torch.Tensor, y_k: torch.Tensor, y_fp: torch.Tensor | None) -> OperatorParity:
    """Rung 3's errors from the float64 outputs of the reference decode, the kernel and the float weights."""
    norm = float(torch.linalg.vector_norm(y_ref)) or 1.0
    e_k = float(torch.linalg.vector_norm(y_k - y_ref))
    if y_fp is None:
        return OperatorParity(e_k, None, e_k / norm, None)
    e_q = float(torch.linalg.vector_norm(y_ref - y_fp))
    return OperatorParity(e_k, e_q, e_k / norm, e_q / (float(torch.linalg.vector_norm(y_fp)) or 1.0))


def metrics_of(p: OperatorParity) -> dict[str, float]:
    metrics = {"e_kernel": p.e_kernel, "rel_kernel": p.rel_kernel}
    if p.e_quant is not None and p.rel_quant is not None:
        metrics.update({"e_quant": p.e_quant, "rel_quant": p.rel_quant})
    return metrics


def rung3_operators(
    m: Module,
    float_weights: Mapping[str, torch.Tensor] | None = None,
    *,
    rows: int = 4,
    seed: int = 0,
    kernel: Kernel | None = None,
    decodes: Mapping[str, np.ndarray] | None = None,
) -> list[RungResult]:
    """Operator parity for every quantized weight meant for a linear (``req=linear``), on seeded
    random inputs (``decodes``: the weights' reference decodes when already computed)."""
    out: list[RungResult] = []
    for name, op, t in weights(m):
        if t.req != "linear" or t.rank != 2:
            continue
        x = rung3_input(name, int(t.shape[1]), rows, seed)
        w = decodes[name] if decodes is not None else decoded(m, op, t)
        p = operator_parity(x, w, (float_weights or {}).get(name), kernel)
        out.append(RungResult(3, name, True, "", metrics_of(p)))
    return out
