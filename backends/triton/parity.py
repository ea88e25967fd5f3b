"""Operator parity of a generated kernel on Triton's CPU interpreter (rung 3 for the triton target).

The kernel runs on stored codes and qparams; the reference is the float64 product with the reference
decode of the same codes. Kernel error (kernel vs reference decode) is reported apart from
quantization error (reference decode vs the float weight, when one is given). Large weights are
checked on a slice of their output columns (``triton-kn`` slices along N exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qcompiler.backends.triton.codegen import KernelKey
from qcompiler.backends.triton.layouts import slice_packed
from qcompiler.backends.triton.runtime import ERROR_BOUND, handle, run_gather, run_linear
from qcompiler.ir.interpret import TORCH, as_torch
from qcompiler.runtime.kernels import Place
from qcompiler.runtime.load import resolve_place
from qcompiler.runtime.rungs import rel

INTERPRET = resolve_place("interpret")
MAX_COLUMNS = 64
"""Output columns checked per weight (the interpreter runs every program in Python)."""


@dataclass(frozen=True)
class KernelParity:
    kernel: str
    rel_kernel: float
    rel_quant: float | None
    bound: float

    @property
    def ok(self) -> bool:
        return self.rel_kernel <= self.bound


def kernel_parity(
    key: KernelKey,
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray | None,
    perm: np.ndarray | None,
    decoded: np.ndarray,
    float_weight: np.ndarray | None = None,
    rows: tuple[int, ...] = (1, 5),
    seed: int = 0,
    place: Place = INTERPRET,
) -> list[KernelParity]:
    """Each of the key's kernels (decode at each of ``rows``, prefill, or gather) against the float64
    reference on the first ``MAX_COLUMNS`` output columns of one stored weight (``scale`` in the key's
    dtype, bf16 as raw uint16 bits), on the interpreter or (``place``) a CUDA device."""
    n = min(codes.shape[1], MAX_COLUMNS)
    k = decoded.shape[1]
    h = handle(
        key,
        torch.from_numpy(slice_packed(codes, key.bits, 0, 0, n).copy()),
        as_torch(scale[:n], key.scale),
        None if zero is None else torch.from_numpy(zero[:n].copy()),
        None if perm is None else torch.from_numpy(perm.copy()),
        k,
        place,
    )
    w_ref = torch.from_numpy(np.ascontiguousarray(decoded[:n])).double()
    w_fp = None if float_weight is None else torch.from_numpy(np.ascontiguousarray(float_weight[:n])).double()
    gen = torch.Generator().manual_seed(seed)
    bound = ERROR_BOUND[key.act if key.op == "linear" else key.out]
    out: list[KernelParity] = []
    if key.op == "embedding":
        ids = torch.randint(0, n, (2, 3), generator=gen)
        got = run_gather(key)(h, ids.to(place.torch_device), None).cpu().double()
        quant = None if w_fp is None else rel(w_ref[ids], w_fp[ids])
        return [KernelParity(f"{key.id}.gather", rel(got, w_ref[ids]), quant, bound)]
    bias = torch.randn(n, generator=gen).to(TORCH[key.out]) if key.bias else None
    b64 = 0 if bias is None else bias.double()
    for phase, m in [("decode", r) for r in rows] + [("prefill", max(rows) + 2)]:
        x = torch.randn(m, k, generator=gen).to(TORCH[key.act])
        dev = place.torch_device
        y = run_linear(key, phase)(h, x.to(dev), None if bias is None else bias.to(dev)).cpu().double()
        want = x.double() @ w_ref.T + b64
        quant = None if w_fp is None else rel(want, x.double() @ w_fp.T + b64)
        out.append(KernelParity(f"{key.id}.{phase}[M={m}]", rel(y, want), quant, bound))
    return out
