"""Every registered ggml codec against gguf-py, the reference numpy implementation of ggml's blocks.

- the type table: ids, names and (block, bytes) agree with ``gguf.GGML_QUANT_SIZES`` for every type;
- quantize: byte for byte equal to ``gguf.quants.quantize`` on N(0,1) rows and on edge rows (zeros,
  constants, exact rounding ties, 1e-30, 6e4, a single non-zero, +max vs -max of equal magnitude);
- dequantize: bit for bit equal to ``gguf.quants.dequantize`` (NaN payloads aside) on our blobs and on
  random bytes (raw, and with every float16 field made finite so the comparison means something);
- ``join(split(b)) == b`` and ``dequantize(b) == decode(split(b))``, with the declared part dtypes/shapes;
- the ``ggml``/``ggml-k`` code layouts are the codecs' ``code_fields``, byte for byte, and ``join_packed``
  (blocks from those bytes and the qparams) is ``join``;
- typed errors that name the type: unsupported types, bad row lengths, removed ids, bad parts, overflow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from gguf import quants

from qcompiler.backends.gguf.codecs import CHUNK, Codec, codecs, get_codec
from qcompiler.backends.gguf.ggml_types import (
    BLOCKS,
    GGML_TYPE_COUNT,
    REMOVED,
    GGMLType,
    GGMLTypeError,
    ggml_type,
    row_bytes,
    row_elements,
)
from qcompiler.ir.dtypes import DTYPES, CodeDType
from qcompiler.ir.layouts import find_layout
from qcompiler.ir.types import Alphabet, CodeContract, DenseType, GroupSpec, PackSpec, QuantType

Array = npt.NDArray[Any]
N = 512  # two 256-blocks, sixteen 32-blocks per row
NOT_IN_GGUF_PY = {GGMLType.Q2_0}  # upstream ggml id 42, newer than gguf-py 0.19.0
QUANTIZABLE = [t for t, c in codecs().items() if c.can_quantize]
C_ORACLE_ONLY = {GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K}  # gguf-py cannot quantize these: test_gguf_kquant


def ids(t: GGMLType) -> str:
    return t.name


def gguf_type(t: GGMLType) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(int(t))


def as_bytes(a: Array, rows: int) -> Array:
    """gguf-py returns F32/F16 quantizations as float arrays; compare their bytes."""
    return np.ascontiguousarray(a).view(np.uint8).reshape(rows, -1)


def assert_same_floats(ours: Array, ref: Array) -> None:
    """Bit-identical float32 (so signed zeros count), except that any NaN equals any NaN."""
    ref = np.asarray(ref, dtype=np.float32)
    assert ours.dtype == np.float32
    assert ours.shape == ref.shape
    same = (ours.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(ours) & np.isnan(ref))
    bad = np.argwhere(~same)
    assert bad.size == 0, f"{len(bad)} differ, first at {tuple(bad[0])}: {ours[tuple(bad[0])]} != {ref[tuple(bad[0])]}"


def tiled(block: list[float] | Array, scale: float = 1.0) -> Array:
    return np.resize(np.asarray(block, dtype=np.float64) * scale, N).astype(np.float32)


def edge_rows() -> Array:
    """Rows on which a careless port differs: exact ties (the scale is exactly 1 or a power of two, so
    ``x * id`` lands on .5), zero and constant blocks, extremes of magnitude, signed maxima."""
    rng = np.random.default_rng(7)
    halves = np.arange(31) - 15.5  # -15.5 .. 14.5
    tie_blocks = [
        [127.0, *halves],  # Q8_0: d = 1, roundf ties away from zero
        [-8.0, *(np.arange(31) / 2 - 7.5)],  # Q4_0: d = 1, x + 8.5 on integers
        [-16.0, *(np.arange(31) - 15.5)],  # Q5_0
        [0.0, 15.0, *(np.arange(30) / 2)],  # Q4_1: min 0, d = 1, x + 0.5 on integers
        [0.0, 31.0, *(np.arange(30) + 0.5)],  # Q5_1
        [1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 0.0, 0.75],  # TQ: d = 1, lroundf ties at +-0.5
    ]
    rows = [tiled(b, s) for b in tie_blocks for s in (1.0, 2.0**-6, 2.0**5)]
    single = np.zeros(N, dtype=np.float32)
    single[37] = 2.5
    pm = np.zeros(N, dtype=np.float32)
    pm[0::32], pm[5::32] = 3.0, -3.0  # equal magnitudes: the first one wins the signed max
    mp = -pm
    rows += [
        np.zeros(N, dtype=np.float32),
        np.full(N, 0.3, dtype=np.float32),
        np.full(N, -7.0, dtype=np.float32),
        np.full(N, 1e-30, dtype=np.float32),
        (rng.standard_normal(N) * 1e-30).astype(np.float32),
        rng.choice([-6e4, 6e4], N).astype(np.float32),
        rng.uniform(-6e4, 6e4, N).astype(np.float32),
        single,
        pm,
        mp,
        tiled([2.5, -2.5, 1.0]),
        tiled([-2.5, 2.5, 1.0]),
    ]
    return np.stack(rows)


def special_floats() -> Array:
    """For the float codecs only: NaNs (quiet, signalling, negative), infinities, float16 overflow,
    subnormals, and float32 values exactly halfway between two bfloat16 values."""
    bits = np.array(
        [0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF, 0x7F800000, 0xFF800000, 0x00000001, 0x80000001,
         0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x477FF000, 0x47800000, 0x33000000, 0x00000000],
        dtype=np.uint32,
    )  # fmt: skip
    return np.resize(bits, (2, N)).view(np.float32)


def finite_f16(parts: dict[str, Array], rng: np.random.Generator) -> dict[str, Array]:
    """The same parts with every float16 part replaced by finite values."""
    return {
        k: (rng.standard_normal(v.shape) * 0.1).astype(np.float16) if v.dtype == np.float16 else v
        for k, v in parts.items()
    }


# ------------------------------------------------------------------------------------------ types


def test_type_table_matches_gguf_py() -> None:
    theirs = {t.name: int(t) for t in gguf.GGMLQuantizationType}
    ours = {t.name: int(t) for t in GGMLType if t not in NOT_IN_GGUF_PY}
    assert ours == theirs
    assert set(BLOCKS) == set(GGMLType)
    for t in GGMLType:
        if t not in NOT_IN_GGUF_PY:
            assert BLOCKS[t] == gguf.GGML_QUANT_SIZES[gguf_type(t)], t.name
    assert BLOCKS[GGMLType.Q2_0] == (64, 18)
    assert max(GGMLType) == GGML_TYPE_COUNT - 1
    assert REMOVED.isdisjoint(int(t) for t in GGMLType)
    assert set(range(GGML_TYPE_COUNT)) == REMOVED | {int(t) for t in GGMLType}


@pytest.mark.parametrize("t", [t for t in GGMLType if t not in NOT_IN_GGUF_PY], ids=ids)
def test_row_bytes_match_gguf_py(t: GGMLType) -> None:
    block, size = BLOCKS[t]
    n = 4 * 256
    assert (3, row_bytes(t, n)) == quants.quant_shape_to_byte_shape((3, n), gguf_type(t))
    assert row_elements(t, row_bytes(t, n)) == n
    if block > 1:
        with pytest.raises(GGMLTypeError, match=t.name):
            row_bytes(t, n + 1)
    if size > 1:
        with pytest.raises(GGMLTypeError, match=t.name):
            row_elements(t, size * 4 + 1)


def test_type_ids() -> None:
    assert ggml_type(12) is GGMLType.Q4_K
    with pytest.raises(GGMLTypeError, match="id 4 was removed"):
        ggml_type(4)
    with pytest.raises(GGMLTypeError, match="unknown ggml type id 43"):
        ggml_type(43)


# ------------------------------------------------------------------------------------------ codecs vs gguf-py


@pytest.mark.parametrize("t", [t for t in QUANTIZABLE if t not in C_ORACLE_ONLY], ids=ids)
def test_quantize_matches_gguf_py(t: GGMLType) -> None:
    codec = get_codec(t)
    rng = np.random.default_rng(0)
    cases = {
        "normal": rng.standard_normal((64, N)).astype(np.float32),
        "edges": edge_rows(),
        "chunks": rng.standard_normal((3 * CHUNK // N + 5, N)).astype(np.float32) * 3,  # quantize works in 4 chunks
    }
    if not codec.finite_only:
        cases["specials"] = special_floats()
    for name, x in cases.items():
        ours = codec.quantize(x)
        with np.errstate(over="ignore"):  # F16: 7e4 -> inf, on purpose
            ref = as_bytes(quants.quantize(x, gguf_type(t)), x.shape[0])
        assert ours.dtype == np.uint8
        assert ours.shape == (x.shape[0], row_bytes(t, N)), name
        bad = np.argwhere(ours != ref)
        assert bad.size == 0, f"{name}: {len(bad)} bytes differ, first at (row, byte) {tuple(bad[0])}"
        assert_same_floats(codec.dequantize(ours), quants.dequantize(ours, gguf_type(t)))


def random_blobs(codec: type[Codec], rng: np.random.Generator) -> dict[str, Array]:
    raw = rng.integers(0, 256, (8, row_bytes(codec.type, N)), dtype=np.uint8)
    return {"raw": raw, "finite": codec.join(finite_f16(codec.split(raw), rng))}


@pytest.mark.parametrize("t", list(codecs()), ids=ids)
def test_dequantize_matches_gguf_py(t: GGMLType) -> None:
    codec = get_codec(t)
    blobs = random_blobs(codec, np.random.default_rng(1))
    if codec.can_quantize:
        blobs["ours"] = codec.quantize(np.random.default_rng(2).standard_normal((8, N)))
    for name, blob in blobs.items():
        ours = codec.dequantize(blob)
        assert ours.shape == (blob.shape[0], N), name
        if name == "finite" and codec.finite_only:  # (float codecs have no float16 parameters)
            assert np.isfinite(ours).all(), name
        with np.errstate(all="ignore"):  # gguf-py warns on inf/NaN scales of random bytes
            ref = quants.dequantize(blob, gguf_type(t))
        assert_same_floats(ours, ref)


@pytest.mark.parametrize("t", list(codecs()), ids=ids)
def test_split_join_is_the_identity(t: GGMLType) -> None:
    codec = get_codec(t)
    rng = np.random.default_rng(3)
    blobs = random_blobs(codec, rng)
    if codec.can_quantize:
        blobs["ours"] = codec.quantize(edge_rows())
    for name, blob in blobs.items():
        parts = codec.split(blob)
        assert list(parts) == [p.name for p in codec.parts]
        for p in codec.parts:
            assert parts[p.name].dtype == np.dtype(p.dtype), (name, p.name)
            assert parts[p.name].shape == (blob.shape[0], N // p.group), (name, p.name)
        assert_same_floats(codec.decode(parts), codec.dequantize(blob))
        again = codec.join(parts)
        if t is GGMLType.TQ1_0 and name == "raw":  # 243 of 256 byte values are canonical
            assert np.array_equal(codec.join(codec.split(again)), again)
            assert_same_floats(codec.dequantize(again), codec.dequantize(blob))
            continue
        assert again.dtype == np.uint8
        assert np.array_equal(again, blob), name


@pytest.mark.parametrize("t", list(codecs()), ids=ids)
def test_empty_tensors(t: GGMLType) -> None:
    codec = get_codec(t)
    for rows, n in ((0, N), (3, 0)):
        blob = np.zeros((rows, row_bytes(t, n)), dtype=np.uint8)
        assert codec.dequantize(blob).shape == (rows, n)
        assert codec.join(codec.split(blob)).shape == blob.shape
        if codec.can_quantize:
            assert codec.quantize(np.zeros((rows, n), dtype=np.float32)).shape == blob.shape


def test_tq1_0_canonical_bytes() -> None:
    """Exactly the 243 ``ceil(v * 256 / 243)`` bytes survive split/join in ``qs``; the rest map to
    the canonical byte with the same trits."""
    codec = get_codec(GGMLType.TQ1_0)
    blob = np.zeros((256, 54), dtype=np.uint8)
    blob[:, 0] = np.arange(256)
    again = codec.join(codec.split(blob))
    assert np.count_nonzero(again[:, 0] == blob[:, 0]) == 243
    canonical = (np.arange(243) * 256 + 242) // 243
    assert np.array_equal(np.unique(again[:, 0]), canonical)


def test_signed_zeros_follow_ggml() -> None:
    """ggml's scans keep the first extreme and start Q4_0's max at +0, so a block of -0.0 quantizes
    like a block of +0.0, and Q4_1's min is the first zero's sign (numpy's min does not say which)."""
    q4_0, q4_1 = get_codec(GGMLType.Q4_0), get_codec(GGMLType.Q4_1)
    zeros = np.zeros((1, 32), dtype=np.float32)
    assert np.array_equal(q4_0.quantize(-zeros), q4_0.quantize(zeros))
    assert q4_0.split(q4_0.quantize(-zeros))["scale"].view(np.uint16)[0, 0] == 0x8000  # d = +0 / -8
    plus_first = np.array([[0.0, -0.0] + [1.0] * 30], dtype=np.float32)
    minus_first = np.array([[-0.0, 0.0] + [1.0] * 30], dtype=np.float32)
    assert q4_1.split(q4_1.quantize(plus_first))["min"].view(np.uint16)[0, 0] == 0x0000
    assert q4_1.split(q4_1.quantize(minus_first))["min"].view(np.uint16)[0, 0] == 0x8000


def code_type(codec: type[Codec], rows: int) -> QuantType:
    """The IR type of ``codec``'s codes in its code layout (``ggml`` for 32-element blocks, else ``ggml-k``)."""
    lo, hi = codec.parts[0].lo or 0, codec.parts[0].hi or 0
    code = CodeDType(lo < 0, (hi - lo).bit_length())
    family = "ggml" if codec.block == 32 else "ggml-k"
    return QuantType(
        family="affine",
        code=CodeContract(code, Alphabet.range(code.min, code.max)),
        expressed=DenseType(DTYPES["f32"], (rows, N)),
        group=GroupSpec(1, codec.block),
        qparams=(("scale", DenseType(DTYPES["f32"], (rows, N // codec.block))),),
        pack=PackSpec(family=family, version=1, encoding=codec.type.name.lower(), tile=(1, codec.block)),
    )


@pytest.mark.parametrize("t", [t for t, c in codecs().items() if c.code_fields], ids=ids)
def test_code_layouts_are_the_code_fields(t: GGMLType) -> None:
    """A code layout holds, per block, the codec's code fields (their sizes, in layout order), and
    packing the codes of the codec's own quantize gives exactly those bytes of its blocks; the code
    fields hold the codes and nothing else (zero qparams leave them, zero codes the others, unchanged)."""
    codec = get_codec(t)
    rows = 5
    qt = code_type(codec, rows)
    layout = find_layout(qt.pack.family, qt.pack.version)
    assert layout is not None
    size = dict(codec.layout)
    assert codec.code_size() == sum(size[f] for f in codec.code_fields)
    assert layout.physical(qt) == (DTYPES["u8"], (rows, N // codec.block * codec.code_size()))
    blob = codec.quantize(np.random.default_rng(4).standard_normal((rows, N)))
    fields = codec._fields(blob.reshape(-1, codec.nbytes))
    code = np.concatenate([fields[f] for f in codec.code_fields], axis=1).reshape(rows, -1)
    parts = codec.split(blob)
    packed = layout.pack(parts["codes"], qt)
    assert packed.dtype == np.uint8
    assert np.array_equal(packed, code)
    assert np.array_equal(codec.code_bytes(blob), code)
    assert np.array_equal(layout.unpack(packed, qt), parts["codes"])
    zero_params = {k: v if k == "codes" else np.zeros_like(v) for k, v in parts.items()}
    assert np.array_equal(codec.code_bytes(codec.join(zero_params)), code)
    others = codec._fields(codec.join({**parts, "codes": np.zeros_like(parts["codes"])}).reshape(-1, codec.nbytes))
    assert all(np.array_equal(others[f], fields[f]) for f in size if f not in codec.code_fields)


def random_qparams(codec: type[Codec], rows: int, rng: np.random.Generator) -> dict[str, Array]:
    """Every qparam part of ``rows`` rows of ``N``: integers anywhere in their range, float16 any bits."""
    out: dict[str, Array] = {}
    for p in codec.parts[1:]:
        shape = (rows, N // p.group)
        if p.dtype == "float16":
            out[p.name] = rng.integers(0, 1 << 16, size=shape).astype(np.uint16).view(np.float16)
        else:
            out[p.name] = rng.integers(p.lo or 0, (p.hi or 0) + 1, size=shape).astype(p.dtype)
    return out


def same_bits(a: Array, b: Array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("t", [t for t, c in codecs().items() if c.code_fields], ids=ids)
def test_join_packed_is_join_without_unpacking(t: GGMLType) -> None:
    """Blocks joined from packed code bytes and qparams are ``join``'s, byte for byte: from the code
    layout of random codes, and from the code bytes of random blocks (TQ1_0's non-canonical bytes
    included: both write the canonical byte); ``split_packed`` gives the code bytes and qparams back."""
    codec, rng, rows = get_codec(t), np.random.default_rng(11), 6
    qt = code_type(codec, rows)
    layout = find_layout(qt.pack.family, qt.pack.version)
    assert layout is not None
    assert codec.parts[0].name == "codes"
    lo, hi = codec.parts[0].lo or 0, codec.parts[0].hi or 0
    codes = rng.integers(lo, hi + 1, size=(rows, N)).astype(codec.parts[0].dtype)
    params = random_qparams(codec, rows, rng)
    want = codec.join({"codes": codes, **params})
    got = codec.join_packed(layout.pack(codes, qt), params)
    assert got.dtype == np.uint8
    assert np.array_equal(got, want)
    back_code, back_params = codec.split_packed(got)
    assert np.array_equal(back_code, layout.pack(codes, qt))
    assert sorted(back_params) == sorted(params)
    assert all(same_bits(back_params[k], v) for k, v in params.items())
    blob = rng.integers(0, 256, size=(rows, row_bytes(t, N)), dtype=np.uint8)
    parts = codec.split(blob)
    qparams = {k: v for k, v in parts.items() if k != "codes"}
    assert np.array_equal(codec.join_packed(codec.code_bytes(blob), qparams), codec.join(parts))
    canonical = codec.code_bytes(codec.join(parts))
    assert np.array_equal(codec.canonical_code_bytes(codec.code_bytes(blob)), canonical)
    assert np.array_equal(codec.canonical_code_bytes(canonical), canonical)


def test_join_packed_checks_its_inputs() -> None:
    q4_k = get_codec(GGMLType.Q4_K)
    params = random_qparams(q4_k, 2, np.random.default_rng(0))
    code = np.zeros((2, N // 256 * 128), np.uint8)
    assert q4_k.join_packed(code, params).shape == (2, N // 256 * 144)
    with pytest.raises(GGMLTypeError, match=r"Q4_K: expected code bytes uint8 \(rows, blocks \* 128\)"):
        q4_k.join_packed(code[:, :100], params)
    with pytest.raises(GGMLTypeError, match="Q4_K: expected parts"):
        q4_k.join_packed(code, {k: v for k, v in params.items() if k != "dmin"})
    with pytest.raises(GGMLTypeError, match=r"Q4_K part 'sub_scale': values must lie in \[0, 63\]"):
        q4_k.join_packed(code, {**params, "sub_scale": params["sub_scale"] | np.uint8(64)})
    with pytest.raises(GGMLTypeError, match=r"Q4_K part 'd': expected float16 \(2, 2\)"):
        q4_k.join_packed(code, {**params, "d": params["d"][:, :1]})
    with pytest.raises(GGMLTypeError, match="F16: expected code bytes"):
        get_codec(GGMLType.F16).join_packed(code, {})


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("t", [t for t in GGMLType if t not in codecs()], ids=ids)
def test_unsupported_type_is_a_typed_error(t: GGMLType) -> None:
    with pytest.raises(GGMLTypeError, match=rf"no codec for ggml type {t.name} \(id {int(t)}\)"):
        get_codec(t)


def test_bad_inputs_are_typed_errors() -> None:
    q4_0, q4_1 = get_codec(GGMLType.Q4_0), get_codec(GGMLType.Q4_1)
    with pytest.raises(GGMLTypeError, match="Q4_0: a row of 33 elements"):
        q4_0.quantize(np.zeros((2, 33), dtype=np.float32))
    with pytest.raises(GGMLTypeError, match="Q4_0: quantize expects rows"):
        q4_0.quantize(np.zeros(32, dtype=np.float32))
    with pytest.raises(GGMLTypeError, match="Q4_0: a row of 19 bytes"):
        q4_0.dequantize(np.zeros((1, 19), dtype=np.uint8))
    with pytest.raises(GGMLTypeError, match="Q4_0: expected uint8 rows"):
        q4_0.split(np.zeros((1, 18), dtype=np.int16))
    x = np.zeros((1, 64), dtype=np.float32)
    x[0, 40] = np.nan
    with pytest.raises(GGMLTypeError, match="Q4_0: non-finite input value at row 0, column 40"):
        q4_0.quantize(x)
    big = np.zeros((3 * CHUNK // 64, 64), dtype=np.float32)
    big[-1, 33] = -1e5  # min = -1e5 does not fit a float16; the row is in the last chunk
    with pytest.raises(
        GGMLTypeError, match=f"Q4_1: non-finite float16 min of the block at row {len(big) - 1}, column 32"
    ):
        q4_1.quantize(big)
    parts = q4_0.split(q4_0.quantize(np.ones((1, 32), dtype=np.float32)))
    with pytest.raises(GGMLTypeError, match=r"Q4_0: expected parts \['codes', 'scale'\]"):
        q4_0.join({"codes": parts["codes"]})
    with pytest.raises(GGMLTypeError, match=r"Q4_0 part 'codes': values must lie in \[-8, 7\]"):
        q4_0.join({**parts, "codes": parts["codes"] - np.int8(1)})
    with pytest.raises(GGMLTypeError, match="Q4_0 part 'scale': expected float16"):
        q4_0.join({**parts, "scale": parts["scale"].astype(np.float32)})


@pytest.mark.parametrize("t", [t for t, c in codecs().items() if c.code_fields], ids=ids)
def test_emit_joins_packed_codes_as_it_joins_logical_ones(t: GGMLType, monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf emit writes the same blocks from codes in the type's code layout (``join_packed``, no unpack)
    as from the same codes in the logical layout (unpacked, then ``join``), row permutation included."""
    from qcompiler.backends.gguf import emit
    from qcompiler.backends.gguf.plan import NEGATED_MIN, NESTED_PARTS, GgufWeight

    codec, rng, rows = get_codec(t), np.random.default_rng(5), 8
    packed_t = code_type(codec, rows)
    layout = find_layout(packed_t.pack.family, packed_t.pack.version)
    assert layout is not None
    codes = rng.integers(codec.parts[0].lo or 0, (codec.parts[0].hi or 0) + 1, size=(rows, N))
    codes = codes.astype(codec.parts[0].dtype)
    path_of = {part: path for path, part in NESTED_PARTS.items()}
    arrays = {"w.codes": layout.pack(codes, packed_t), "w.logical": codes}
    qparams = random_qparams(codec, rows, rng)
    for name, a in qparams.items():
        negate = name == "min" and packed_t.pack.encoding in NEGATED_MIN  # the IR's min is -m
        arrays[f"w.{path_of.get(name, name)}"] = -a if negate else a
    refs = {k.removeprefix("w."): k for k in arrays if k != "w.logical"}
    monkeypatch.setattr(emit, "read_array", lambda m, name: arrays[name])  # pyright: ignore[reportUnknownLambdaType]
    packed = GgufWeight("w", None, packed_t, refs)  # pyright: ignore[reportArgumentType]
    # the codes left in the logical layout; the encoding kept (emit reads Q4_1/Q5_1's min as -m by it)
    logical_t = dataclasses.replace(packed_t, pack=PackSpec(encoding=packed_t.pack.encoding))
    logical = GgufWeight("w", None, logical_t, {**refs, "codes": "w.logical"})  # pyright: ignore[reportArgumentType]
    assert emit.packed_codes(packed, t)
    assert not emit.packed_codes(logical, t)
    perm = rng.permutation(rows)
    for order in (None, perm):
        fast = emit.quantized_payload(None, packed, t, order)  # pyright: ignore[reportArgumentType]
        slow = emit.quantized_payload(None, logical, t, order)  # pyright: ignore[reportArgumentType]
        assert bytes(fast) == bytes(slow)
    want = codec.join({"codes": codes[perm], **{k: v[perm] for k, v in qparams.items()}})
    assert bytes(fast) == want.tobytes()
