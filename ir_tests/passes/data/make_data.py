"""Writes the tiny raw tensors that ir_tests/passes/*.qir reference
(both passes read tensor bytes), and prints the sha256 of each (the hashes the .qir files spell).
Bytes are little-endian, row-major, no header.

Run from anywhere: python ir_tests/passes/data/make_data.py

freeze-semantics: ``fs_*`` hold a source's quantization state (codes, scales, zero points) and the
effective weight the source's own dequantize produced. Every effective weight here is computed with
the affine v1 contract ``float32(code - zero) * float32(scale)`` (one float32 multiply), so the pass
can prove decode == effective; the ``*_bad`` files break that in exactly one place.

canonicalize-axes: ``ca_*_kn`` is a weight stored [K, N] = [10, 4] with groups of 4 along K (axis 0,
a short tail group of 2); ``ca_*_nk`` are their transposes, written only so that their sha256 (the
hash the pass's output must spell) is printed here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def expand(q: np.ndarray, group: int, axis: int, size: int) -> np.ndarray:
    """Repeat per-group qparams over their group along ``axis`` (a short tail group allowed)."""
    return np.repeat(q, group, axis=axis).take(np.arange(size), axis=axis)


def affine(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, group: int, axis: int) -> np.ndarray:
    """``float32(code - zero) * float32(scale)``: the affine v1 decode, groups along ``axis``."""
    k = codes.shape[axis]
    diff = codes.astype(np.int64)
    if zero is not None:
        diff = diff - expand(zero.astype(np.int64), group, axis, k)
    return (diff.astype(np.float32) * expand(scale.astype(np.float32), group, axis, k)).astype("<f4")


# freeze-semantics: a [4, 10] weight, groups of 4 along K (groups of 4, 4 and a tail of 2).
FS_CODES = ((np.arange(40).reshape(4, 10) * 7) % 16 - 8).astype("<i1")
"""i4 codes in [-8, 7] (both ends used), one per byte."""
FS_SCALE = np.array([[0.5, 0.25, 0.125], [1.5, 0.75, 2.0], [0.1, 0.2, 0.3], [3.0, 0.0625, 1.25]], dtype="<f4")
"""f32[4, 3]: one scale per group; 0.1, 0.2 and 0.3 are inexact in binary, so rounding is exercised."""
FS_ZERO = np.array([[0, -1, 3], [2, 0, -8], [7, 1, 0], [-3, 4, 5]], dtype="<i8")
"""i64[4, 3] zero points (PT2E stores them wide); freeze-semantics narrows them to i8."""
FS_EFFECTIVE = affine(FS_CODES, FS_SCALE, None, 4, 1)
FS_EFFECTIVE_ASYM = affine(FS_CODES, FS_SCALE, FS_ZERO, 4, 1)

FS_EFFECTIVE_BAD = FS_EFFECTIVE.copy()
FS_EFFECTIVE_BAD[2, 9] = np.nextafter(FS_EFFECTIVE_BAD[2, 9], np.float32(np.inf))
"""One ulp off at [2, 9] (the tail group of row 2); every other element is exact."""
FS_CODES_OOB = FS_CODES.copy()
FS_CODES_OOB[1, 2] = 9
"""codes[1, 2] = 9 lies outside a declared [-8, 7]."""

# PT2E-style per-channel int8: scale f32[4] and zero point i64[4] (all zero), block [1, 10].
FS_PC_CODES = ((np.arange(40).reshape(4, 10) * 37) % 256 - 128).astype("<i1")
FS_PC_SCALE = np.array([0.01, 0.02, 0.5, 0.0078125], dtype="<f4")
FS_PC_ZERO = np.zeros(4, dtype="<i8")
FS_PC_EFFECTIVE = affine(FS_PC_CODES, FS_PC_SCALE.reshape(4, 1), None, 10, 1)

# canonicalize-axes: stored [K, N] = [10, 4], groups of 4 along K (axis 0).
CA_CODES_KN = ((np.arange(40).reshape(10, 4) * 5) % 16 - 8).astype("<i1")
CA_SCALE_KN = np.array([[0.5, 0.25, 1.0, 2.0], [0.125, 0.75, 1.5, 0.375], [3.0, 0.0625, 0.1, 4.0]], dtype="<f2")
CA_ZERO_KN = np.array([[0, 1, -2, 3], [-4, 5, -6, 7], [1, 0, 0, -1]], dtype="<i1")

# pack-layouts / place-shards: a canonical [4, 16] weight, groups of 8 along K, f32 scales, i8 zeros.
PL_CODES = ((np.arange(64).reshape(4, 16) * 11) % 16 - 8).astype("<i1")
PL_SCALE = np.array([[0.5, 0.25], [1.5, 0.75], [0.1, 0.2], [3.0, 0.0625]], dtype="<f4")
PL_ZERO = np.array([[0, -1], [2, -8], [7, 1], [-3, 4]], dtype="<i1")


def ct_pack_int4(codes: np.ndarray) -> np.ndarray:
    """compressed-tensors pack-quantized, written out longhand (independent of qcompiler's packer):
    u = q + 8, eight 4-bit values per int32 word, element 8w + j in bits 4j..4j+3."""
    n, k = codes.shape
    out = np.zeros((n, k // 8), dtype="<u4")
    for r in range(n):
        for c in range(k):
            out[r, c // 8] |= np.uint32(int(codes[r, c]) + 8) << np.uint32(4 * (c % 8))
    return out.view("<i4")


TABLE: dict[str, np.ndarray] = {
    "fs_codes.bin": FS_CODES,
    "fs_scale.bin": FS_SCALE,
    # the same scales as f64: every value is exactly a float32, so the pass stores them as f32.
    "fs_scale_f64.bin": FS_SCALE.astype("<f8"),
    # all-zero f32 zero points (PT2E group-wise): a symmetric weight, the zero slot is dropped.
    "fs_zero_f32.bin": np.zeros((4, 3), dtype="<f4"),
    "fs_zero.bin": FS_ZERO,
    # the same zero points narrowed to i8: written only for the hash the pass's output must spell.
    "fs_zero_i8.bin": FS_ZERO.astype("<i1"),
    # zero points of the wrong count: 8 values where the scale has 12.
    "fs_zero_short.bin": FS_ZERO[:, :2].copy(),
    "fs_effective.bin": FS_EFFECTIVE,
    "fs_effective_asym.bin": FS_EFFECTIVE_ASYM,
    "fs_effective_bad.bin": FS_EFFECTIVE_BAD,
    "fs_codes_oob.bin": FS_CODES_OOB,
    "fs_pc_codes.bin": FS_PC_CODES,
    "fs_pc_scale.bin": FS_PC_SCALE,
    "fs_pc_zero.bin": FS_PC_ZERO,
    "fs_pc_effective.bin": FS_PC_EFFECTIVE,
    "ca_codes_kn.bin": CA_CODES_KN,
    "ca_scale_kn.bin": CA_SCALE_KN,
    "ca_zero_kn.bin": CA_ZERO_KN,
    "ca_codes_nk.bin": np.ascontiguousarray(CA_CODES_KN.T),
    "ca_scale_nk.bin": np.ascontiguousarray(CA_SCALE_KN.T),
    "ca_zero_nk.bin": np.ascontiguousarray(CA_ZERO_KN.T),
    "pl_codes.bin": PL_CODES,
    "pl_scale.bin": PL_SCALE,
    "pl_zero.bin": PL_ZERO,
    # what pack-layouts{target=safetensors} must produce: written only for its hash.
    "pl_codes_ct.bin": ct_pack_int4(PL_CODES),
    # the f32 scales rounded to f16 (scale-dtype conversion): written only for its hash.
    "pl_scale_f16.bin": PL_SCALE.astype("<f2"),
}


def main() -> None:
    for name, arr in TABLE.items():
        data = np.ascontiguousarray(arr).tobytes()
        (HERE / name).write_bytes(data)
        print(f"{name}: {arr.dtype.str}{list(arr.shape)} {len(data)} bytes sha256:{hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
