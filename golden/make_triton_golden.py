"""Regenerate golden/triton/: the ``triton-kn`` v1 byte layout pinned (run: ``python golden/make_triton_golden.py``).

Each ``golden/triton/kn_<i|u><bits>.npz`` holds ``codes`` (int16, logical ``[N, K]``: every code of the
width appears, in a scrambled order) and ``packed`` (uint8 ``[K / per, N]``), computed here by a scalar
loop, one byte at a time, independently of ``qcompiler.backends.triton.layouts``: byte ``(kb, n)`` is the
OR over ``j`` of ``(codes[n, kb * per + j] + offset) << (bits * j)``, ``offset = 2^(bits-1)`` for signed
codes. The kernels and every artifact depend on this layout; a change to it must change its version.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "triton"
N, K = 3, 96


def codes_for(bits: int, signed: bool) -> np.ndarray:
    lo = -(1 << (bits - 1)) if signed else 0
    values = np.arange(lo, lo + (1 << bits), dtype=np.int16)
    flat = np.resize(values, N * K)
    order = np.random.default_rng(bits * 2 + signed).permutation(N * K)
    return flat[order].reshape(N, K)


def pack_scalar(codes: np.ndarray, bits: int, offset: int) -> np.ndarray:
    per = 8 // bits
    n, k = codes.shape
    out = np.zeros((k // per, n), dtype=np.uint8)
    for kb in range(k // per):
        for col in range(n):
            byte = 0
            for j in range(per):
                byte |= (int(codes[col, kb * per + j]) + offset) << (bits * j)
            out[kb, col] = byte
    return out


def cases() -> dict[str, dict[str, np.ndarray]]:
    out: dict[str, dict[str, np.ndarray]] = {}
    for bits in (2, 4, 8):
        for signed in (True, False):
            codes = codes_for(bits, signed)
            offset = 1 << (bits - 1) if signed else 0
            out[f"kn_{'i' if signed else 'u'}{bits}"] = {"codes": codes, "packed": pack_scalar(codes, bits, offset)}
    return out


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, arrays in cases().items():
        np.savez(OUT / f"{name}.npz", **arrays)  # pyright: ignore[reportArgumentType]


if __name__ == "__main__":
    main()
