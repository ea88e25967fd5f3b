"""Small float formats: 8-bit float elements as value tables (bit pattern -> float32 value), and
bfloat16 rounding.

``E4M3FN`` is the OCP float8 E4M3 format of ``torch.float8_e4m3fn`` and safetensors ``F8_E4M3``:
1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, subnormals, no infinities, NaN only at
``0x7f``/``0xff`` (so the largest finite value is 448). Every value is exact in float32.
"""

from __future__ import annotations

import numpy as np


def e4m3fn_table() -> np.ndarray:
    """float32 ``[256]``: the value of each E4M3FN bit pattern (computed from the fields, not by a cast)."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    subnormal = (man / 8.0) * np.exp2(-6.0)
    values = sign * np.where(exp == 0, subnormal, normal)
    values[(exp == 0xF) & (man == 0x7)] = np.nan
    return values.astype(np.float32)


E4M3FN = e4m3fn_table()
E4M3FN.setflags(write=False)


def e4m3fn_nan_at(codes: np.ndarray) -> tuple[int, ...] | None:
    """The first (row-major) index of ``codes`` (uint8 E4M3FN bit patterns) holding one of the two NaN
    patterns, 0x7f and 0xff, or ``None``: no weight is NaN, so readers and freeze refuse them."""
    nan = (codes & 0x7F) == 0x7F
    return tuple(int(i) for i in np.argwhere(nan)[0]) if nan.any() else None


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), returned as float32. NaN stays NaN."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    rounded = (((bits + 0x7FFF + lsb) >> 16) << 16) & 0xFFFFFFFF  # carries into the exponent on overflow: inf
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out).astype(np.float32)
