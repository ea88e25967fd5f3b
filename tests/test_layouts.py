"""Code layouts: ``unpack(pack(Q)) == Q`` for every registered layout, and the compressed-tensors
layout bit for bit against compressed-tensors' own packer (the real peer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompiler.ir.dtypes import DTYPES, CodeDType
from qcompiler.ir.layouts import find_layout
from qcompiler.ir.types import Alphabet, CodeContract, DenseType, GroupSpec, PackSpec, QuantType


def qtype(n: int, k: int, bits: int, family: str = "logical", encoding: str = "none", signed: bool = True) -> QuantType:
    code = CodeDType(signed, bits)
    return QuantType(
        family="affine",
        code=CodeContract(code, Alphabet.range(code.min, code.max)),
        expressed=DenseType(DTYPES["f32"], (n, k)),
        group=GroupSpec(1, k),
        qparams=(("scale", DenseType(DTYPES["f32"], (n, 1))),),
        pack=PackSpec(family=family, version=1, encoding=encoding, tile=(1, 1)),
    )


GENERIC = [("logical", 1), ("ct-pack-quantized", 1), ("ggml", 1), ("ggml-k", 1)]
"""The layouts these generic tests cover, each found through its backend's declaration (the same set
whatever other tests of this worker imported before; each backend's own tests cover its others)."""
LAYOUTS = [(fam, ver, enc) for fam, ver in GENERIC for enc in getattr(find_layout(fam, ver), "encodings", ())]
FIXED: dict[str, tuple[int, bool, int]] = {
    "q8_0": (8, True, 32),
    "q4_0": (4, True, 32),
    "q5_0": (5, True, 32),
    "q4_1": (4, False, 32),
    "q5_1": (5, False, 32),
    "q4_k": (4, False, 256),
    "q5_k": (5, False, 256),
    "q6_k": (6, True, 256),
    "tq2_0": (2, True, 256),
    "tq1_0": (2, True, 256),
}
TERNARY = {"tq2_0", "tq1_0"}
"""Encodings whose codes are {-1, 0, 1}."""
"""Block layouts fix the code width and signedness, and K must be whole blocks."""


@pytest.mark.parametrize(("family", "version", "encoding"), LAYOUTS)
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 70), st.integers(2, 8), st.integers(0, 2**32 - 1))
def test_every_layout_round_trips(
    family: str, version: int, encoding: str, n: int, k: int, bits: int, seed: int
) -> None:
    layout = find_layout(family, version)
    assert layout is not None
    signed = True
    if encoding in FIXED:
        bits, signed, block = FIXED[encoding]
        k = block * (1 + k % 3)
    t = qtype(n, k, bits, family, encoding, signed)
    rng = np.random.default_rng(seed)
    lo = -1 if encoding in TERNARY else t.code.dtype.min
    codes = rng.integers(lo, t.code.dtype.max + 1, size=(n, k)).astype(np.int8 if signed else np.uint8)
    blob = layout.pack(codes, t)
    dtype, shape = layout.physical(t)
    assert blob.shape == shape
    assert blob.dtype == np.dtype(dtype.numpy)
    assert np.array_equal(layout.unpack(blob, t), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("k", [32, 64, 96, 40])
def test_ct_pack_quantized_matches_compressed_tensors(bits: int, k: int) -> None:
    layout = find_layout("ct-pack-quantized", 1)
    assert layout is not None
    t = qtype(5, k, bits, "ct-pack-quantized", "offset-binary-lsb")
    rng = np.random.default_rng(bits * 100 + k)
    codes = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=(5, k)).astype(np.int8)
    ours = layout.pack(codes, t)
    theirs = pack_to_int32(torch.from_numpy(codes), bits).numpy()
    assert ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)
    back = unpack_from_int32(torch.from_numpy(ours), bits, torch.Size([5, k])).numpy()
    assert np.array_equal(back, codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_ct_packing_by_row_blocks_matches_compressed_tensors(monkeypatch: pytest.MonkeyPatch, bits: int) -> None:
    """Packed a few rows at a time (the last block short), the words are compressed-tensors' own, and
    they unpack, and pass the padding check, block by block."""
    from qcompiler.backends.safetensors import layouts as layouts_ct

    monkeypatch.setattr(layouts_ct, "ROW_BLOCK", 3 * 70)  # 3 rows of K = 70 a block
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = np.random.default_rng(bits).integers(lo, hi + 1, size=(10, 70), dtype=np.int8)
    packed = layouts_ct.pack_rows(codes, bits)
    theirs = pack_to_int32(torch.from_numpy(codes), bits).numpy()
    assert np.array_equal(packed, theirs)
    assert np.array_equal(layouts_ct.unpack_rows(packed, bits, 10, 70), codes)
    assert layouts_ct.padding_bits_clear(packed, bits, 70)
    dirty = packed.copy()
    dirty[7, -1] |= np.int32(1 << 30)
    assert not layouts_ct.padding_bits_clear(dirty, bits, 70)  # bit 30 of a row's last word is padding here


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_every_byte_unpacks_to_its_fields(bits: int) -> None:
    """``spread_bytes`` (the unpacking of byte-aligned widths) on all 256 byte values, in rows: each
    byte's fields, least significant first, less the offset."""
    from qcompiler.backends.safetensors.layouts import spread_bytes

    raw = np.arange(256, dtype=np.uint8).reshape(4, 64)
    per = 8 // bits
    fields = (raw.astype(np.int16)[..., None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)
    want = (fields - (1 << (bits - 1))).astype(np.int8).reshape(4, 64 * per)
    assert np.array_equal(spread_bytes(raw, bits), want)
