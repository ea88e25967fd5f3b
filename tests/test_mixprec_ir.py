"""The ``mixprec`` family (2/4/16-bit in one weight, nested scales, exclusive outliers): descriptor rules,
its rate, the reference decoder (the seed's worked example, swapped levels), the packed planes layout
and every cross-stream rule that needs bytes."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

from qcompiler.ir import parse_type
from qcompiler.ir.descriptor import DescriptorError, check_descriptor, rate_claim
from qcompiler.ir.layouts import LayoutError, find_layout, logical_view
from qcompiler.ir.mixprec import PlanesLayout, data_problem, four_bit, map_problem, pack2, pad
from qcompiler.ir.reference import DecodeError, decode
from qcompiler.ir.types import PackSpec, QuantType
from qcompiler.quant.mixprec import MixedQuant

PLANES = "pack=(family=mixprec, version=1, encoding=planes-a16, tile=[1,1])"


def mix_type(
    n: int, k: int, g: int, g2: int, n4: int, nnz: int, second_axis: int = 0, pack: str = PLANES, rows4: int = 0
) -> QuantType:
    """``n4`` groups listed in ``wide``, ``rows4`` rows in ``wide_rows``."""
    ng = k // g
    sn = -(-n // g2) if second_axis == 0 else n
    sg = ng if second_axis == 0 else -(-ng // g2)
    return quant(
        f"!q.mixprec<u4[0:15] -> f32[{n},{k}], group=(axis=1, size={g}, tail=partial), qparams={{scale: "
        f"!q.affine<u8[0:255] -> f32[{n},{ng}], group=(axis={second_axis}, size={g2}, tail=partial), "
        f"qparams={{scale: f16[{sn},{sg}], zero: u8[{sn},{sg}]}}, req=qparam>, zero: u8[{n},{ng}]}}, "
        f"exceptions={{wide: i16[{n4}], wide_rows: i16[{rows4}], col: i16[{nnz}], rowptr: i32[{n + 1}], "
        f"value: f16[{nnz}]}}, {pack}, req=linear>"
    )


def quant(text: str) -> QuantType:
    t = parse_type(text)
    assert isinstance(t, QuantType)
    return t


def logical(t: QuantType) -> QuantType:
    return dataclasses.replace(t, pack=PackSpec())


def random_weight(
    n: int = 8, k: int = 64, g: int = 16, g2: int = 4, seed: int = 0, full: tuple[int, ...] = ()
) -> tuple[QuantType, dict[str, Any]]:
    """A valid weight: a third of the groups 4-bit (every group of the rows ``full``), two outliers per
    row in its 2-bit groups; the map canonical (all-4-bit rows in ``wide_rows``)."""
    rng = np.random.default_rng(seed)
    ng = k // g
    is4 = rng.random((n, ng)) < 0.34
    is4[list(full)] = True
    whole: np.ndarray = np.all(is4, axis=1)
    limit = np.where(is4, 15, 3).repeat(g, axis=1)
    codes = (rng.integers(0, 16, (n, k)) % (limit + 1)).astype(np.uint8)
    zero = (rng.integers(0, 16, (n, ng)) % (np.where(is4, 15, 3) + 1)).astype(np.uint8)
    cols: list[int] = []
    rowptr = [0]
    for r in range(n):
        narrow = [c for c in range(k) if not is4[r, c // g]]
        picked = sorted(rng.choice(narrow, size=min(2, len(narrow)), replace=False).tolist())
        for c in picked:
            codes[r, c] = zero[r, c // g]
        cols += picked
        rowptr.append(len(cols))
    nnz = len(cols)
    parts: dict[str, Any] = {
        "codes": codes,
        "zero": zero,
        "scale": {
            "codes": rng.integers(0, 256, (n, ng)).astype(np.uint8),
            "scale": (rng.random((-(-n // g2), ng)) * 0.01 + 0.001).astype(np.float16),
            "zero": rng.integers(0, 256, (-(-n // g2), ng)).astype(np.uint8),
        },
        "wide": np.flatnonzero((is4 & ~whole[:, None]).reshape(-1)).astype(np.int16),
        "wide_rows": np.flatnonzero(whole).astype(np.int16),
        "col": np.array(cols, dtype=np.int16),
        "rowptr": np.array(rowptr, dtype=np.int32),
        "value": rng.normal(0, 4, nnz).astype(np.float16),
    }
    rows4 = int(whole.sum())
    return mix_type(n, k, g, g2, int(is4.sum()) - rows4 * ng, nnz, rows4=rows4), parts


def test_worked_example_decodes_second_level_then_first() -> None:
    """q_s=5, z2=1, s2=0.25 -> s1=1; q_w=3, z1=2 -> w=1."""
    t = logical(mix_type(1, 16, 16, 4, 0, 0))
    parts: dict[str, Any] = {
        "codes": np.full((1, 16), 3, np.uint8),
        "zero": np.full((1, 1), 2, np.uint8),
        "scale": {"codes": np.full((1, 1), 5, np.uint8), "scale": np.full((1, 1), 0.25, np.float16)},
        "wide": np.zeros(0, np.int16),
        "wide_rows": np.zeros(0, np.int16),
        "col": np.zeros(0, np.int16),
        "rowptr": np.zeros(2, np.int32),
        "value": np.zeros(0, np.float16),
    }
    parts["scale"]["zero"] = np.full((1, 1), 1, np.uint8)
    assert np.array_equal(decode(t, parts), np.ones((1, 16), np.float32))
    swapped = {
        **parts,
        "zero": np.full((1, 1), 1, np.uint8),
        "scale": {**parts["scale"], "zero": np.full((1, 1), 2, np.uint8)},
    }
    assert not np.array_equal(decode(t, swapped), np.ones((1, 16), np.float32))  # (3-1) * (5-2)*0.25 = 1.5


def test_second_level_along_the_input_axis_is_refused() -> None:
    with pytest.raises(DescriptorError, match="second-level groups run along the output axis"):
        check_descriptor(mix_type(8, 64, 16, 2, 0, 0, second_axis=1))


def test_text_round_trips_and_rate_follows_from_the_descriptor() -> None:
    t = mix_type(8, 64, 16, 4, 5, 3)
    assert parse_type(str(t)) == t
    check_descriptor(t)
    claim = rate_claim(t, ("codes", "scale", "zero", "exceptions"))
    codes = 2 * 8 * 64 + 2 * 16 * 5
    scale = 8 * 4 * 8 + 2 * 4 * (16 + 8)
    exceptions = 5 * 16 + 3 * 16 + 9 * 32 + 3 * 16
    assert (claim.bits, claim.per) == (codes + scale + 8 * 4 * 8 + exceptions, 512)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("!q.mixprec<i4[-8:7] -> f32[8,64], group=(axis=1, size=16, tail=partial), qparams={scale: f16[8,4], "
         "zero: u8[8,4]}, exceptions={wide: i16[0], wide_rows: i16[0], col: i16[0], rowptr: i32[9], "
         "value: f16[0]}>", "code"),
        ("!q.mixprec<u4[0:15] -> f32[8,64], group=(axis=1, size=24, tail=partial), qparams={scale: f16[8,3], "
         "zero: u8[8,3]}, exceptions={wide: i16[0], wide_rows: i16[0], col: i16[0], rowptr: i32[9], "
         "value: f16[0]}>", "group"),
        ("!q.mixprec<u4[0:15] -> f32[8,64], group=(axis=1, size=16, tail=partial), qparams={scale: f16[8,4], "
         "zero: u8[8,4]}, exceptions={wide: i16[0], wide_rows: i16[0], col: i16[0], rowptr: i32[8], "
         "value: f16[0]}>", "exceptions"),
        ("!q.mixprec<u4[0:15] -> f32[8,64], group=(axis=1, size=16, tail=partial), qparams={scale: f16[8,4], "
         "zero: i8[8,4]}, exceptions={wide: i16[0], wide_rows: i16[0], col: i16[0], rowptr: i32[9], "
         "value: f16[0]}>", "qparams"),
        ("!q.mixprec<u4[0:15] -> f32[8,64], group=(axis=1, size=16, tail=partial), qparams={scale: f16[8,4], "
         "zero: u8[8,4]}, exceptions={wide: i16[0], wide_rows: i16[0], col: i16[2], rowptr: i32[9], "
         "value: f16[3]}>", "exceptions"),
    ],
)  # fmt: skip
def test_descriptor_rules(text: str, field: str) -> None:
    with pytest.raises(DescriptorError) as e:
        check_descriptor(quant(text))
    assert e.value.field == field


def test_planes_round_trip_and_alignment() -> None:
    t, parts = random_weight()
    layout = find_layout("mixprec", 1)
    assert layout is PlanesLayout
    blob = PlanesLayout.pack(parts["codes"], t, parts)
    dtype, shape = PlanesLayout.physical(t)
    assert (blob.dtype.name, blob.shape) == (dtype.numpy, shape)
    low, high = PlanesLayout.planes(t)
    assert shape[0] % 16 == 0
    assert (low, high) == (8 * 64 // 4, parts["wide"].shape[0] * 16 // 4)
    codes, lt = logical_view(blob, t, parts)
    assert np.array_equal(codes, parts["codes"])
    assert lt.pack == PackSpec()
    assert decode(lt, parts).shape == (8, 64)
    with pytest.raises(LayoutError, match="wrong length"):
        PlanesLayout.unpack(blob[:-16], t, parts)  # the alignment dropped
    dirty = blob.copy()
    dirty[-1] = 1
    if high % 16:
        with pytest.raises(LayoutError, match="padding must be zero"):
            PlanesLayout.unpack(dirty, t, parts)
    with pytest.raises(LayoutError, match="needs this slot"):
        logical_view(blob, t)


def test_reordered_groups_are_caught() -> None:
    """Swapping two 4-bit groups' high planes and their map entries reconstructs the same matrix but
    breaks the map's order: refused."""
    t, parts = random_weight(seed=3)
    wide = parts["wide"].copy()
    wide[[0, 1]] = wide[[1, 0]]
    with pytest.raises(DecodeError, match="strictly increasing"):
        decode(logical(t), {**parts, "wide": wide})


def test_pack_refuses_a_wide_code_in_a_2_bit_group() -> None:
    t, parts = random_weight()
    codes = parts["codes"].copy()
    narrow = np.ones(codes.size // 16, bool)
    narrow[parts["wide"].astype(np.int64)] = False
    first = int(np.flatnonzero(narrow)[0])
    codes.reshape(-1, 16)[first, 0] = 9
    with pytest.raises(LayoutError, match="2-bit group holds a code above 3"):
        PlanesLayout.pack(codes, t, parts)


def test_decode_applies_outliers_by_replacement() -> None:
    t, parts = random_weight(seed=5)
    got = decode(logical(t), parts)
    rows = np.repeat(np.arange(8), np.diff(parts["rowptr"]))
    assert np.array_equal(got[rows, parts["col"].astype(np.int64)], parts["value"].astype(np.float32))
    base = decode(logical(t), {**parts, "value": np.zeros_like(parts["value"])})
    assert np.array_equal(base[rows, parts["col"].astype(np.int64)], np.zeros(rows.size, np.float32))


def bad(parts: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**parts, **changes}


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ("wide_out", "wide", "strictly increasing inside the map"),
        ("code_wide", "codes[", "code wider than its group"),
        ("zero_wide", "zero[", "zero point wider than its group"),
        ("rowptr", "rowptr", "row pointers"),
        ("col_out", "col[", "outlier column outside the row"),
        ("col_order", "col[", "strictly increasing within a row"),
        ("in_wide", "col[", "outliers only inside 2-bit groups"),
        ("not_zero", "codes[", "the code under an outlier is its group's zero point"),
    ],
)
def test_cross_stream_rules(change: str, field: str, message: str) -> None:
    t, parts = random_weight(seed=7)
    wide, codes, zero = parts["wide"], parts["codes"].copy(), parts["zero"].copy()
    narrow = np.ones(codes.size // 16, bool)
    narrow[wide.astype(np.int64)] = False
    g2 = int(np.flatnonzero(narrow)[0])
    if change == "wide_out":
        parts = bad(parts, wide=np.append(wide[:-1], 10_000).astype(np.int16))
    elif change == "code_wide":
        codes.reshape(-1, 16)[g2, 1] = 7 if codes.reshape(-1, 16)[g2, 1] != 7 else 8
        parts = bad(parts, codes=codes)
    elif change == "zero_wide":
        zero.reshape(-1)[g2] = 9
        parts = bad(parts, zero=zero)
    elif change == "rowptr":
        parts = bad(parts, rowptr=np.append(parts["rowptr"][:-1], 99).astype(np.int32))
    elif change == "col_out":
        parts = bad(parts, col=np.append(parts["col"][:-1], 64).astype(np.int16))
    elif change == "col_order":
        col = parts["col"].copy()
        col[[0, 1]] = col[[1, 0]]
        parts = bad(parts, col=col)
    elif change == "in_wide":
        g4 = int(wide[0])
        r, c = g4 // 4, (g4 % 4) * 16
        col, rowptr = parts["col"].astype(np.int64), parts["rowptr"]
        row_cols = sorted([*col[rowptr[r] : rowptr[r + 1]].tolist(), c])
        new = np.concatenate([col[: rowptr[r]], row_cols, col[rowptr[r + 1] :]]).astype(np.int16)
        codes[r, c] = zero[r, c // 16]
        value = np.insert(parts["value"], int(rowptr[r]), np.float16(1))
        parts = bad(parts, col=new, codes=codes, value=value, rowptr=(rowptr + (np.arange(9) > r)).astype(np.int32))
        t = mix_type(8, 64, 16, 4, wide.shape[0], new.shape[0])
    elif change == "not_zero":
        c = int(parts["col"][0])
        codes[0, c] = (zero[0, c // 16] + 1) % 4
        parts = bad(parts, codes=codes)
    with pytest.raises(DecodeError) as e:
        decode(logical(t), parts)
    assert str(e.value).startswith(field)
    assert message in str(e.value)


def test_an_i16_rowptr_is_accepted_while_it_counts_the_outliers() -> None:
    t = quant(str(mix_type(8, 64, 16, 4, 5, 3)).replace("rowptr: i32[9]", "rowptr: i16[9]"))
    check_descriptor(t)
    claim = rate_claim(t, ("codes", "scale", "zero", "exceptions"))
    assert (
        claim.bits == rate_claim(mix_type(8, 64, 16, 4, 5, 3), ("codes", "scale", "zero", "exceptions")).bits - 9 * 16
    )
    _, parts = random_weight()
    narrow = dict(parts, rowptr=parts["rowptr"].astype(np.int16))
    wide_t = random_weight()[0]
    t16 = quant(str(wide_t).replace("rowptr: i32[9]", "rowptr: i16[9]"))
    assert np.array_equal(decode(logical(t16), narrow), decode(logical(wide_t), parts))
    too_many = quant(
        str(mix_type(8, 64, 16, 4, 0, 0))
        .replace("rowptr: i32[9]", "rowptr: i16[9]")
        .replace("col: i16[0]", "col: i16[32768]")
        .replace("value: f16[0]", "value: f16[32768]")
    )
    with pytest.raises(DescriptorError) as e:
        check_descriptor(too_many)
    assert e.value.field == "exceptions"
    assert "32767" in str(e.value)


# --------------------------------------------------------------------------- whole 4-bit rows (wide_rows)


def retyped(parts: dict[str, Any]) -> QuantType:
    """``random_weight``'s descriptor (8 x 64, G=16, G2=4) for ``parts``' own map and outlier lengths."""
    n4, rows4, nnz = parts["wide"].shape[0], parts["wide_rows"].shape[0], parts["col"].shape[0]
    return mix_type(8, 64, 16, 4, n4, nnz, rows4=rows4)


def test_planes_round_trip_with_whole_rows() -> None:
    """Rows 1 and 6 whole (``wide_rows``) beside single 4-bit groups (``wide``): the high plane holds
    every 4-bit group's bits in flat group order, its length counts the rows' groups, and it unpacks."""
    t, parts = random_weight(seed=11, full=(1, 6))
    assert parts["wide_rows"].tolist() == [1, 6]
    assert parts["wide"].size > 0
    assert not np.isin(parts["wide"] // 4, [1, 6]).any()
    blob = PlanesLayout.pack(parts["codes"], t, parts)
    low, high = PlanesLayout.planes(t)
    assert high == (parts["wide"].shape[0] + 2 * 4) * 16 // 4
    assert blob.shape == (pad(low) + pad(high),)
    groups = four_bit(8, 4, parts["wide"], parts["wide_rows"])
    assert groups.tolist() == sorted([*parts["wide"].tolist(), 4, 5, 6, 7, 24, 25, 26, 27])
    bits = (parts["codes"].reshape(-1, 16)[groups] >> 2).reshape(-1)
    assert np.array_equal(blob[pad(low) : pad(low) + high], pack2(bits))
    codes, _ = logical_view(blob, t, parts)
    assert np.array_equal(codes, parts["codes"])
    assert bool(np.any(codes[[1, 6]] > 3))


def test_reference_decode_with_whole_rows_equals_the_quantizers() -> None:
    """The reference decoder and ``MixedQuant.decode`` on the same arrays with ``wide_rows``: bit for bit."""
    t, parts = random_weight(seed=12, full=(0, 3, 7))
    assert parts["wide_rows"].tolist() == [0, 3, 7]
    s = parts["scale"]
    q = MixedQuant(
        codes=parts["codes"], zero=parts["zero"], scale_codes=s["codes"], scale2=s["scale"], zero2=s["zero"],
        wide=parts["wide"], wide_rows=parts["wide_rows"], rowptr=parts["rowptr"], col=parts["col"],
        value=parts["value"], group=16, group2=4,
    )  # fmt: skip
    got = decode(logical(t), parts)
    assert got.dtype == np.float32
    assert got.tobytes() == q.decode().tobytes()
    assert bool(np.all(q.group_bits()[[0, 3, 7]] == 4))
    assert q.n4 == parts["wide"].shape[0] + 3 * 4


def map_case(change: str, parts: dict[str, Any]) -> dict[str, Any]:
    """``parts`` (row 2 whole, in ``wide_rows`` = [2, 5]) with its map changed as ``change`` says."""
    wide, rows = parts["wide"].astype(np.int64), parts["wide_rows"].astype(np.int64)
    if change == "rows_order":
        rows = rows[::-1]
    elif change == "rows_range":
        rows = np.append(rows, 8)
    elif change == "row_group_in_wide":
        wide = np.union1d(wide, [2 * 4 + 1])
    else:  # "row_spelled_out": row 2 moved from wide_rows into wide, all four of its groups
        rows, wide = rows[rows != 2], np.union1d(wide, 2 * 4 + np.arange(4))
    return {**parts, "wide": wide.astype(np.int16), "wide_rows": rows.astype(np.int16)}


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ("rows_order", "wide_rows[1]", "4-bit rows strictly increasing inside the weight"),
        ("rows_range", "wide_rows[2]", "4-bit rows strictly increasing inside the weight"),
        ("row_group_in_wide", "wide[", "a group of a row already in 'wide_rows'"),
        ("row_spelled_out", "wide[", "a row whose groups are all 4-bit is listed in 'wide_rows'"),
    ],
)
def test_the_map_is_canonical(change: str, field: str, message: str) -> None:
    """``map_problem``, ``data_problem`` (the reference decoder's gate) and the planes layout refuse a
    map out of order, out of range, listing a group of a listed row, or spelling a whole row out."""
    _, parts = random_weight(seed=13, full=(2, 5))
    assert parts["wide_rows"].tolist() == [2, 5]
    bad = map_case(change, parts)
    problem = map_problem(8, 4, bad["wide"], bad["wide_rows"])
    assert problem is not None
    assert (problem.field.startswith(field), problem.message) == (True, message)
    t = retyped(bad)
    assert data_problem(logical(t), bad["codes"], bad) == problem
    with pytest.raises(DecodeError) as e:
        decode(logical(t), bad)
    assert str(e.value).startswith(field)
    assert message in str(e.value)
    with pytest.raises(LayoutError, match=re.escape(message)):
        PlanesLayout.pack(bad["codes"], t, bad)
    if change == "row_spelled_out":  # the same 4-bit groups, the same bytes: only the spelling is refused
        assert np.array_equal(
            four_bit(8, 4, bad["wide"], bad["wide_rows"]), four_bit(8, 4, parts["wide"], parts["wide_rows"])
        )
        assert "row 2" in problem.found
