"""Writes the tiny raw tensors that ir_tests/invalid/data-invalid.qir references, and prints the
sha256 of each (the hashes the .qir file spells). Bytes are little-endian, row-major, no header.

Run from anywhere: python ir_tests/invalid/data/make_data.py
Each file is deliberately wrong in one way (or a valid companion of a wrong one); see the table.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def codes_ok() -> np.ndarray:
    """i4 codes in [-8, 7], stored one per byte (i8[4,8])."""
    return (np.arange(32, dtype=np.int64).reshape(4, 8) % 16 - 8).astype("<i1")


def codes_oob() -> np.ndarray:
    """Like codes_ok, but codes[1,2] = 9 lies outside i4's [-8:7]."""
    c = codes_ok()
    c[1, 2] = 9
    return c


TABLE: dict[str, np.ndarray] = {
    "codes_ok.bin": codes_ok(),
    "codes_oob.bin": codes_oob(),
    # f16[4,1] per-row scales; a valid companion of the codes above.
    "scale.bin": np.full((4, 1), 0.5, dtype="<f2"),
    # ternary codes i8[2,8] in {-1,0,1}, except [0,5] = 2.
    "ternary_bad.bin": np.array([[-1, 0, 1, 0, -1, 2, 1, 0], [0, 0, 1, -1, 1, 0, -1, 1]], dtype="<i1"),
    "ternary_scale.bin": np.full((2, 1), 0.25, dtype="<f2"),
    # i32[8] permutations: a duplicate (3 at positions 1 and 5, 5 missing), and one out of range (9).
    "perm_dup.bin": np.array([0, 3, 2, 1, 4, 3, 6, 7], dtype="<i4"),
    "perm_range.bin": np.array([0, 1, 2, 9, 4, 5, 6, 7], dtype="<i4"),
    # 16 bytes: half of what an i8[4,8] codes tensor needs.
    "short.bin": np.zeros(16, dtype="<i1"),
    # nested (K-quant-like) sub-block scale codes u6 as u8[4,4]: [2,3] = 64 is outside [0:63].
    "sub_oob.bin": np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 64], [0, 63, 1, 2]], dtype="<u1"),
    # nested weight codes u4 as u8[4,32], all valid (0..15).
    "ncodes.bin": (np.arange(128).reshape(4, 32) % 16).astype("<u1"),
    # f16[4,1] super-block scales for the sub-block codes.
    "super.bin": np.full((4, 1), 0.125, dtype="<f2"),
    # valid u6 sub-block scale codes as u8[4,4], and f16[4,1] super-block scales with [2,0] = nan.
    "sub_ok.bin": np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [0, 63, 1, 2]], dtype="<u1"),
    "super_nan.bin": np.array([[0.125], [0.125], [np.nan], [0.125]], dtype="<f2"),
    # f16[4,1] per-row scales with [1,0] = +inf.
    "scale_inf.bin": np.array([[0.5], [np.inf], [0.5], [0.5]], dtype="<f2"),
    # bf16[4,1] per-row scales as raw bits: 0.5 (0x3F00) except [3,0] = nan (0x7FC0).
    "scale_bf16_nan.bin": np.array([[0x3F00], [0x3F00], [0x3F00], [0x7FC0]], dtype="<u2"),
    # mixed family: i3 codes in [-4, 3] as i8[4,8]; three exceptions with f16 values.
    "mixed_codes.bin": (np.arange(32).reshape(4, 8) % 8 - 4).astype("<i1"),
    "exc_value.bin": np.array([1.5, -2.0, 3.25], dtype="<f2"),
    # exception indices i32[3]: [1] = 40 is outside the 4x8 tensor (flat indices 0..31) ...
    "exc_index_oob.bin": np.array([2, 40, 7], dtype="<i4"),
    # ... and [2] = 9 repeats [1] (indices must be strictly increasing).
    "exc_index_order.bin": np.array([3, 9, 9], dtype="<i4"),
}


def main() -> None:
    for name, arr in TABLE.items():
        data = np.ascontiguousarray(arr).tobytes()
        (HERE / name).write_bytes(data)
        print(f"{name}: {arr.dtype.str}{list(arr.shape)} {len(data)} bytes sha256:{hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
