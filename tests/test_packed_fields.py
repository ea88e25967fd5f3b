"""``gptq_awq.fields``, the unpacking every GPTQ, AWQ and compressed-tensors reader and reference
decode rests on, against bit-by-bit extraction: field ``j`` of a block of words is bits
``[j * b, (j + 1) * b)`` of the block, LSB first, for every width and both packing axes (the 2/4/8-bit
fields are read from the words' bytes, the 3-bit ones straddle words)."""

from __future__ import annotations

import numpy as np
import pytest

from qcompiler.backends.safetensors.gptq_awq import PACKING, fields


def bit_by_bit(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    values, span = PACKING[bits]
    u = np.moveaxis(words.view(np.uint32).astype(np.uint64), axis, -1)
    blocks = u.reshape(*u.shape[:-1], u.shape[-1] // span, span)
    out = np.zeros((*blocks.shape[:-1], values), dtype=np.int64)
    for j in range(values):
        for bit in range(bits):
            word, shift = divmod(j * bits + bit, 32)
            out[..., j] |= (((blocks[..., word] >> np.uint64(shift)) & np.uint64(1)) << np.uint64(bit)).astype(np.int64)
    return np.moveaxis(out.reshape(*u.shape[:-1], -1), -1, axis)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("bits", sorted(PACKING))
def test_fields_are_the_bits_lsb_first(bits: int, axis: int) -> None:
    span = PACKING[bits][1]
    rng = np.random.default_rng(bits * 2 + axis)
    words = rng.integers(-(2**31), 2**31, size=(6 * span, 10 * span), dtype=np.int64).astype(np.int32)
    got = fields(words, bits, axis)
    assert got.dtype == np.int16
    assert np.array_equal(got, bit_by_bit(words, bits, axis))
