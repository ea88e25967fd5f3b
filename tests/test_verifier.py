"""Verifier: typed errors with where/field/expected/found; descriptor invariants; data checks; and
the extension points (families, layouts, ops register without touching the core)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from qcompiler.errors import ParseError, VerifyError
from qcompiler.examples import tiny_llama
from qcompiler.ir import Op, parse_module, parse_type, print_module, verify_module
from qcompiler.ir import types as types_module
from qcompiler.ir.core import Module
from qcompiler.ir.data_checks import nonfinite
from qcompiler.ir.descriptor import DescriptorError, check_descriptor, expected_qparam_shape
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.families import Family
from qcompiler.ir.types import DenseType, GroupSpec, QuantType

Z = "0" * 64
W4 = (
    "!q.affine<i4[-8:7] -> f32[64,96], unit=element, rev=1, group=(axis=1, size=32, tail=partial), "
    "qparams={scale: f16[64,3]}, decoder=1, pack=(family=logical, version=1, encoding=none, tile=[1,1]), req=linear>"
)


def w4() -> QuantType:
    t = parse_type(W4)
    assert isinstance(t, QuantType)
    return t


def module_text(weight_type: str = W4, scale_shape: str = "64,3", k: int = 96) -> str:
    return f"""module @m {{
  tensor @w.codes : i8[64,{k}] = blob<"sha256:{Z}", "mem">
  tensor @w.scale : f16[{scale_shape}] = blob<"sha256:{Z}", "mem">
  graph @g(%x: tensor<f32[?b,{k}]>) {{
    %w = q.weight() {{codes = @w.codes, scale = @w.scale}} : {weight_type}
    %y = q.linear(%x, %w) : tensor<f32[?b,64]>
    return(%y)
  }}
}}
"""


def verify_error(text: str) -> VerifyError:
    with pytest.raises(VerifyError) as info:
        verify_module(parse_module(text, "t.qir"))
    return info.value


def test_valid_module_verifies() -> None:
    verify_module(parse_module(module_text()))


def test_qparam_shape_must_be_ceil_k_over_g() -> None:
    bad = W4.replace("qparams={scale: f16[64,3]}", "qparams={scale: f16[64,2]}")
    e = verify_error(module_text(bad, "64,2"))
    assert e.where == "%w = q.weight"
    assert e.field == "qparam 'scale'"
    assert (e.expected, e.found) == ("[64,3]", "[64,2]")
    assert e.loc is not None
    assert e.loc.line == 5
    assert str(e).startswith("t.qir:5:5: error: %w = q.weight: qparam 'scale':")


def test_tail_group_counts_the_short_group() -> None:
    t = dataclasses.replace(w4(), expressed=dataclasses.replace(w4().expressed, shape=(64, 70)))
    assert expected_qparam_shape(t) == (64, 3)


def test_tile_must_divide_padded_shape() -> None:
    partial = W4.replace("f32[64,96]", "f32[64,70]").replace("tile=[1,1]", "tile=[1,32]")
    e = verify_error(module_text(partial, "64,3", k=70))
    assert (e.field, e.found) == ("pack", "[64,70]")
    padded = partial.replace("tail=partial", "tail=pad")
    verify_module(parse_module(module_text(padded, "64,3", k=70)))


def test_codes_blob_must_match_layout_shape() -> None:
    e = verify_error(module_text().replace("tensor @w.codes : i8[64,96]", "tensor @w.codes : u8[64,96]"))
    assert (e.field, e.expected, e.found) == ("codes", "i8[64,96]", "u8[64,96]")


def test_alphabet_must_fit_code_type() -> None:
    with pytest.raises(DescriptorError, match="alphabet does not fit i4"):
        check_descriptor(
            dataclasses.replace(w4(), code=dataclasses.replace(w4().code, alphabet=type(w4().code.alphabet)(-9, 7)))
        )


def test_req_is_checked_by_consumers() -> None:
    e = verify_error(module_text(W4.replace("req=linear", "req=embedding")))
    assert e.where == "%y = q.linear"
    assert e.found == "req=embedding"


def test_result_type_must_follow_from_operands() -> None:
    e = verify_error(
        module_text().replace(
            "%y = q.linear(%x, %w) : tensor<f32[?b,64]>", "%y = q.linear(%x, %w) : tensor<f32[?b,65]>"
        )
    )
    assert e.field == "result %y"
    assert e.expected == "tensor<f32[?b,64]>"


def test_parse_errors_carry_line_column_and_show_the_line() -> None:
    text = module_text().replace("f16[64,3]", "f16[64;3]", 1)
    with pytest.raises(ParseError) as info:
        parse_module(text, "bad.qir")
    e = info.value
    assert (e.loc.line, e.loc.column) == (3, 27)
    rendered = str(e).splitlines()
    assert rendered[0] == "bad.qir:3:27: error: unexpected character ';'"
    assert rendered[1] == e.loc.line_text
    assert rendered[2].index("^") == 26


# --------------------------------------------------------------------------- data checks


def write_blob(d: Path, name: str, arr: np.ndarray) -> str:
    data = arr.tobytes()
    (d / name).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def data_module(d: Path, codes: np.ndarray, perm: np.ndarray) -> Module:
    hc = write_blob(d, "codes.bin", codes.astype(np.int8))
    hs = write_blob(d, "scale.bin", np.ones((4, 1), np.float16))
    hp = write_blob(d, "perm.bin", perm.astype(np.int32))
    t = (
        "!q.affine<i4[-8:7] -> f32[4,8], unit=element, rev=1, group=(axis=1, size=8, tail=partial), "
        "qparams={scale: f16[4,1]}, perm=i32[8], decoder=1, pack=(family=logical, version=1, encoding=none, "
        "tile=[1,1]), req=linear>"
    )
    text = f"""module @m {{
  tensor @c : i8[4,8] = blob<"sha256:{hc}", "file:codes.bin">
  tensor @s : f16[4,1] = blob<"sha256:{hs}", "file:scale.bin">
  tensor @p : i32[8] = blob<"sha256:{hp}", "file:perm.bin">
  graph @g() {{
    %w = q.weight() {{codes = @c, scale = @s, perm = @p}} : {t}
    return(%w)
  }}
}}
"""
    m = parse_module(text)
    m.base_dir = str(d)
    return m


def test_data_checks_pass_on_good_bytes(tmp_path: Path) -> None:
    m = data_module(tmp_path, np.arange(32).reshape(4, 8) % 16 - 8, np.arange(8)[::-1])
    verify_module(m, data=True)


def test_code_outside_alphabet(tmp_path: Path) -> None:
    codes = np.zeros((4, 8))
    codes[2, 5] = 9
    with pytest.raises(VerifyError) as info:
        verify_module(data_module(tmp_path, codes, np.arange(8)), data=True)
    assert (info.value.field, info.value.expected, info.value.found) == ("codes[2,5]", "[-8:7]", "9")


def packed_module(d: Path, codes: np.ndarray, alphabet: str) -> Module:
    """A ct-pack-quantized (int32 words of 4-bit fields) weight with the given alphabet."""
    from qcompiler.backends.safetensors.layouts import pack_rows

    hc = write_blob(d, "packed.bin", pack_rows(codes.astype(np.int8), 4))
    hs = write_blob(d, "scale.bin", np.ones((4, 1), np.float16))
    t = (
        f"!q.affine<i4{alphabet} -> f32[4,8], unit=element, rev=1, group=(axis=1, size=8, tail=partial), "
        "qparams={scale: f16[4,1]}, decoder=1, pack=(family=ct-pack-quantized, version=1, "
        "encoding=offset-binary-lsb, tile=[1,1]), req=linear>"
    )
    text = f"""module @m {{
  tensor @c : i32[4,1] = blob<"sha256:{hc}", "file:packed.bin">
  tensor @s : f16[4,1] = blob<"sha256:{hs}", "file:scale.bin">
  graph @g() {{
    %w = q.weight() {{codes = @c, scale = @s}} : {t}
    return(%w)
  }}
}}
"""
    m = parse_module(text)
    m.base_dir = str(d)
    return m


def test_packed_fields_are_checked_unless_every_value_they_hold_is_in_the_alphabet(tmp_path: Path) -> None:
    codes = np.zeros((4, 8))
    codes[1, 3] = -8
    verify_module(packed_module(tmp_path, codes, "[-8:7]"), data=True)  # 4-bit fields hold only -8..7
    with pytest.raises(VerifyError) as info:
        verify_module(packed_module(tmp_path, codes, "[-7:7]"), data=True)
    assert (info.value.field, info.value.expected, info.value.found) == ("codes[1,3]", "[-7:7]", "-8")
    m = packed_module(tmp_path, codes, "[-8:7]")
    (tmp_path / "packed.bin").write_bytes(b"\x01" + bytes(15))
    with pytest.raises(VerifyError, match=r"tensor @c: bytes: sha256 mismatch"):
        verify_module(m, data=True)  # the bytes are still checked


def test_permutation_must_be_a_bijection(tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match=r"perm\[0\] = perm\[1\] = 0"):
        verify_module(data_module(tmp_path, np.zeros((4, 8)), np.array([0, 0, 1, 2, 3, 4, 5, 6])), data=True)


def test_hash_mismatch_names_the_tensor(tmp_path: Path) -> None:
    m = data_module(tmp_path, np.zeros((4, 8)), np.arange(8))
    (tmp_path / "codes.bin").write_bytes(b"\x01" + bytes(31))
    with pytest.raises(VerifyError, match=r"tensor @c: bytes: sha256 mismatch"):
        verify_module(m, data=True)


def test_file_locations_cannot_escape(tmp_path: Path) -> None:
    m = data_module(tmp_path, np.zeros((4, 8)), np.arange(8))
    m.tensors["c"].blob = dataclasses.replace(m.tensors["c"].blob, location="file:../codes.bin")
    with pytest.raises(VerifyError, match=re.escape("file location '../codes.bin': path has a '..' component")):
        verify_module(m, data=True)


def many_weights(d: Path, bad_codes: set[int], bad_bytes: set[int]) -> Module:
    """Six weights (codes and a scale each); those in ``bad_codes`` hold a code outside the alphabet,
    those in ``bad_bytes`` a scale file whose bytes no longer match its sha256."""
    t = (
        "!q.affine<i4[-8:7] -> f32[4,8], unit=element, rev=1, group=(axis=1, size=8, tail=partial), "
        "qparams={scale: f16[4,1]}, decoder=1, pack=(family=logical, version=1, encoding=none, "
        "tile=[1,1]), req=linear>"
    )
    tensors, ops = [], []
    for i in range(6):
        codes = np.zeros((4, 8), np.int8)
        codes[1, i] = 9 if i in bad_codes else 0
        hc = write_blob(d, f"c{i}.bin", codes)
        hs = write_blob(d, f"s{i}.bin", np.full((4, 1), i + 1, np.float16))
        if i in bad_bytes:
            (d / f"s{i}.bin").write_bytes(bytes(8))
        tensors += [
            f'  tensor @c{i} : i8[4,8] = blob<"sha256:{hc}", "file:c{i}.bin">',
            f'  tensor @s{i} : f16[4,1] = blob<"sha256:{hs}", "file:s{i}.bin">',
        ]
        ops.append(f"    %w{i} = q.weight() {{codes = @c{i}, scale = @s{i}}} : {t}")
    results = ", ".join(f"%w{i}" for i in range(6))
    body = "\n".join([*tensors, "  graph @g() {", *ops, f"    return({results})", "  }"])
    m = parse_module(f"module @m {{\n{body}\n}}\n")
    m.base_dir = str(d)
    return m


@pytest.mark.parametrize("jobs", [1, 2, 4])
def test_the_first_failure_is_raised_for_any_thread_count(tmp_path: Path, jobs: int) -> None:
    """The data checks run in threads (``check_data(m, jobs)``); the failure raised is the first in
    table order for the bytes, then in op order for the codes, whatever the count."""
    from qcompiler.ir.data_checks import check_data

    check_data(many_weights(tmp_path, set(), set()), jobs)
    with pytest.raises(VerifyError) as info:
        check_data(many_weights(tmp_path, {2, 4}, set()), jobs)
    assert (info.value.where, info.value.field) == ("%w2 = q.weight", "codes[1,2]")
    with pytest.raises(VerifyError, match=r"tensor @s1: bytes: sha256 mismatch"):
        check_data(many_weights(tmp_path, {0}, {1, 5}), jobs)  # bytes are checked before codes


# --------------------------------------------------------------------------- extension points


def test_new_family_registers_without_touching_the_core() -> None:
    class Lut(Family, name="test-lut"):
        required = ("table",)

    try:
        t = dataclasses.replace(w4(), family="test-lut", qparams=(("table", w4().qparams[0][1]),))
        check_descriptor(t)
        with pytest.raises(DescriptorError, match="family test-lut requires qparam 'table'"):
            check_descriptor(dataclasses.replace(t, qparams=()))
        assert str(t).startswith("!q.test-lut<")
    finally:
        del Family.registry["test-lut"]
    assert Lut.name == "test-lut"


def test_ops_register_by_name_and_reject_duplicates() -> None:
    assert {"q.linear", "q.embedding", "q.quantize", "q.dequantize", "q.weight", "sdpa", "rotary"} <= set(Op.registry)
    with pytest.raises(TypeError, match="registered twice"):
        type("Again", (Op,), {}, name="linear")


def test_every_op_and_type_has_a_docstring_with_an_example() -> None:
    for name, cls in Op.registry.items():
        doc = cls.__doc__ or ""
        assert doc.strip(), name
    assert "!q.affine<" in (types_module.__doc__ or "")
    assert "tensor<f32[?batch,?seq,64]>" in (types_module.__doc__ or "")


def test_group_spec_prints_tail_rule() -> None:
    assert str(GroupSpec(1, 32, "pad")) == "(axis=1, size=32, tail=pad)"


def test_example_verifies_with_data() -> None:
    m = tiny_llama()
    verify_module(m, data=True)
    assert "q.embedding" in print_module(m)


def test_eight_bit_float_nan_patterns_are_non_finite() -> None:
    raw = np.array([0x7F, 0xFF, 0x7E, 0x00], np.uint8)
    e4m3 = DenseType(DTYPES["f8e4m3"], (4,))
    assert nonfinite(raw, e4m3).tolist() == [True, True, False, False]
    e5m2 = DenseType(DTYPES["f8e5m2"], (4,))
    assert nonfinite(np.array([0x7C, 0xFE, 0x7B, 0x3C], np.uint8), e5m2).tolist() == [True, True, False, False]
    bf16 = DenseType(DTYPES["bf16"], (2,))
    assert nonfinite(np.array([0x7FC0, 0x3F80], np.uint16), bf16).tolist() == [True, False]


def test_mixed_exception_values_must_be_float() -> None:
    t = parse_type(
        "!q.mixed<i3[-4:3] -> f16[16,64], unit=element, rev=1, group=(axis=1, size=16, tail=partial), "
        "qparams={scale: f16[16,4]}, exceptions={index: i32[12], value: i8[12]}, decoder=1, "
        "pack=(family=logical, version=1, encoding=none, tile=[1,1]), req=linear>"
    )
    assert isinstance(t, QuantType)
    with pytest.raises(DescriptorError, match="exception values must be a float tensor"):
        check_descriptor(t)


def test_a_weight_names_itself_from_its_codes_symbol() -> None:
    """``Weight.weight_name`` reads the symbol, so a name that prints quoted (``@"a b.codes"``) keeps
    its spelling (the string surgery on ``str(attrs["codes"])`` it replaces kept the quotes)."""
    from qcompiler.ir.attrs import SymbolRef
    from qcompiler.ir.core import Value, create_op
    from qcompiler.ir.dtypes import DTYPES, code_dtype
    from qcompiler.ir.ops.quant import Weight, weight_name
    from qcompiler.ir.types import Alphabet, CodeContract, DenseType, GroupSpec, QuantType

    i4 = code_dtype("i4")
    assert i4 is not None
    t = QuantType(
        "affine",
        CodeContract(i4, Alphabet.range(-8, 7)),
        DenseType(DTYPES["f32"], (2, 4)),
        GroupSpec(1, 4),
        (("scale", DenseType(DTYPES["f32"], (2, 1))),),
    )
    w = create_op("q.weight", [], [t], {"codes": SymbolRef('layers.0 "odd".codes'), "scale": SymbolRef("s")})
    assert isinstance(w, Weight)
    assert str(w.attrs["codes"]).startswith('@"')
    assert w.weight_name == weight_name(w) == 'layers.0 "odd"'
    with pytest.raises(TypeError, match=r"is not a q\.weight"):
        weight_name(create_op("q.dequantize", [Value("w", t)], [t.expressed]))
