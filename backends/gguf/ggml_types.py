"""The ggml tensor types: ids exactly as llama.cpp's ``enum ggml_type`` numbers them, and one block table.

Every ggml type stores a row as whole blocks: ``BLOCKS[t] = (elements per block, bytes per block)``.
Plain types (F32, I8, ...) are blocks of one element. Ids 4, 5, 31-33 and 36-38 belonged to types
that were removed from ggml (their block size is 0); a file naming one is rejected.

Example::

    >>> from qcompiler.backends.gguf.ggml_types import BLOCKS, GGMLType, ggml_type, row_bytes
    >>> BLOCKS[GGMLType.Q4_0]
    (32, 18)
    >>> row_bytes(GGMLType.Q4_0, 4096)
    2304
    >>> ggml_type(12).name
    'Q4_K'
"""

from __future__ import annotations

from enum import IntEnum

from qcompiler.errors import QcError


class GGMLTypeError(QcError):
    """A type id, a row length or a blob does not fit its ggml type. The message names the type."""


class GGMLType(IntEnum):
    """``enum ggml_type`` (ggml/include/ggml.h): the id a GGUF tensor info stores."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


GGML_TYPE_COUNT = 43
"""One past the largest id; a GGUF tensor type must lie in ``[0, GGML_TYPE_COUNT)``."""

REMOVED: frozenset[int] = frozenset({4, 5, 31, 32, 33, 36, 37, 38})
"""Ids of removed types (Q4_2, Q4_3, Q4_0_4_4, Q4_0_4_8, Q4_0_8_8, IQ4_NL_4_4, IQ4_NL_4_8, IQ4_NL_8_8)."""

QK_K = 256
"""Elements in a K-quant (and TQ, most IQ) super-block."""

BLOCKS: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q8_1: (32, 4 + 4 + 32),
    GGMLType.Q2_K: (QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    GGMLType.Q3_K: (QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    GGMLType.Q8_K: (QK_K, 4 + QK_K + QK_K // 8),
    GGMLType.IQ2_XXS: (QK_K, 2 + QK_K // 4),
    GGMLType.IQ2_XS: (QK_K, 2 + QK_K // 4 + QK_K // 32),
    GGMLType.IQ3_XXS: (QK_K, 2 + QK_K // 4 + QK_K // 8),
    GGMLType.IQ1_S: (QK_K, 2 + QK_K // 8 + QK_K // 16),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ3_S: (QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    GGMLType.IQ2_S: (QK_K, 2 + QK_K // 4 + QK_K // 16),
    GGMLType.IQ4_XS: (QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (QK_K, 48 + 4 + 2),
    GGMLType.TQ2_0: (QK_K, QK_K // 4 + 2),
    GGMLType.MXFP4: (32, 1 + 16),
    GGMLType.NVFP4: (64, 4 + 32),
    GGMLType.Q1_0: (128, 2 + 16),
    GGMLType.Q2_0: (64, 2 + 16),
}


def ggml_type(type_id: int) -> GGMLType:
    """The type with id ``type_id``; ``GGMLTypeError`` for a removed or unknown id."""
    if type_id in REMOVED:
        raise GGMLTypeError(f"ggml type id {type_id} was removed from ggml (block size 0)")
    try:
        return GGMLType(type_id)
    except ValueError:
        raise GGMLTypeError(
            f"unknown ggml type id {type_id} (expected one of 0..{GGML_TYPE_COUNT - 1}, not removed)"
        ) from None


def row_bytes(t: GGMLType, n: int) -> int:
    """Bytes of one row of ``n`` elements of type ``t``; ``n`` must be a whole number of blocks."""
    block, size = BLOCKS[t]
    if n < 0 or n % block:
        raise GGMLTypeError(f"{t.name}: a row of {n} elements is not a whole number of {block}-element blocks")
    return n // block * size


def row_elements(t: GGMLType, nbytes: int) -> int:
    """Elements in one row of ``nbytes`` bytes of type ``t``; ``nbytes`` must be a whole number of blocks."""
    block, size = BLOCKS[t]
    if nbytes < 0 or nbytes % size:
        raise GGMLTypeError(f"{t.name}: a row of {nbytes} bytes is not a whole number of {size}-byte blocks")
    return nbytes // size * block
