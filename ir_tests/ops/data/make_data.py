"""Writes the tiny raw tensors that ir_tests/ops/data-valid.qir references, and prints the sha256
of each (the hashes the .qir file spells). Bytes are little-endian, row-major, no header.

Run from anywhere: python ir_tests/ops/data/make_data.py
Every file here is valid for the descriptor that uses it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

CODES = (np.arange(32).reshape(4, 8) // 2 % 16 - 8).astype("<i1")
"""i4 codes in [-8, 7] (both ends used), one per byte: i8[4,8]."""

SHARD_HEADER = 16
"""shard.bin holds 16 header bytes, then a second i8[4,8] weight read at "file:data/shard.bin@16"."""

MID_HEADER, MID_TRAILER = 8, 8
"""mid.bin holds 8 header bytes, a third i8[4,8] weight read at "file:data/mid.bin@8", then 8 more
bytes: the offset read takes exactly the tensor's 32 bytes from the middle of the file."""

MID_CODES = CODES[::-1].copy()

TABLE: dict[str, bytes] = {
    "codes.bin": CODES.tobytes(),
    "shard.bin": bytes(range(SHARD_HEADER)) + (-1 - CODES.astype(np.int64)).astype("<i1").tobytes(),
    # f16[4,1] per-row scales.
    "scale.bin": np.array([[0.5], [0.25], [1.0], [2.0]], dtype="<f2").tobytes(),
    # i32[8] act-order permutation: a bijection of 0..7.
    "perm.bin": np.array([3, 0, 7, 1, 6, 2, 5, 4], dtype="<i4").tobytes(),
    # ternary codes i8[2,8] in {-1,0,1} and f16[2,1] scales.
    "ternary.bin": np.array([[-1, 0, 1, 0, -1, 1, 1, 0], [0, 0, 1, -1, 1, 0, -1, 1]], dtype="<i1").tobytes(),
    "ternary_scale.bin": np.array([[0.25], [0.5]], dtype="<f2").tobytes(),
    # nested: u4 codes as u8[4,32]; u6 sub-block scale codes as u8[4,4] (0 and 63 both used);
    # f16[4,1] super-block scales.
    "ncodes.bin": (np.arange(128).reshape(4, 32) % 16).astype("<u1").tobytes(),
    "nsub.bin": np.array([[0, 1, 2, 3], [10, 20, 30, 40], [63, 62, 61, 60], [7, 7, 7, 7]], dtype="<u1").tobytes(),
    "nsuper.bin": np.full((4, 1), 0.125, dtype="<f2").tobytes(),
    "mid.bin": bytes(range(100, 100 + MID_HEADER)) + MID_CODES.tobytes() + bytes(range(200, 200 + MID_TRAILER)),
    # mixed: i3 codes in [-4, 3] as i8[4,8], and three exceptions at strictly increasing flat
    # indices of the 4x8 tensor (both ends used) with f16 values.
    "mcodes.bin": (np.arange(32).reshape(4, 8) % 8 - 4).astype("<i1").tobytes(),
    "exc_index.bin": np.array([0, 17, 31], dtype="<i4").tobytes(),
    "exc_value.bin": np.array([1.5, -2.0, 3.25], dtype="<f2").tobytes(),
}


def main() -> None:
    for name, data in TABLE.items():
        (HERE / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes sha256:{hashlib.sha256(data).hexdigest()}")
    tail = TABLE["shard.bin"][SHARD_HEADER:]
    print(f"shard.bin@{SHARD_HEADER}: {len(tail)} bytes sha256:{hashlib.sha256(tail).hexdigest()}")
    mid = TABLE["mid.bin"][MID_HEADER:-MID_TRAILER]
    print(f"mid.bin@{MID_HEADER}: {len(mid)} bytes sha256:{hashlib.sha256(mid).hexdigest()}")


if __name__ == "__main__":
    main()
