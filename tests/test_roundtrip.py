"""Round-trip properties of the textual IR.

- every valid ``.qir`` file under ir_tests/ prints back byte for byte through ``qcompiler opt``;
- ``qcompiler opt F | qcompiler opt -`` is idempotent;
- ``parse(print(m))`` is structurally equal to ``m`` (the built-in example, and random types).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompiler.examples import tiny_llama
from qcompiler.ir import parse_module, parse_type, print_module, split_input, verify_module
from qcompiler.ir.dtypes import DTYPES, CodeDType
from qcompiler.ir.equality import modules_equal
from qcompiler.ir.types import (
    Alphabet,
    CodeContract,
    DenseType,
    GroupSpec,
    PackSpec,
    QuantType,
    RateClaim,
)
from qcompiler.testing import Cli

ROOT = Path(__file__).resolve().parents[1]
VALID_QIR = sorted(
    p for p in (ROOT / "ir_tests").rglob("*.qir") if not {"invalid", "Output", "data"} & set(p.relative_to(ROOT).parts)
)


def test_ir_tests_exist() -> None:
    assert len(VALID_QIR) >= 5


@pytest.mark.parametrize("path", VALID_QIR, ids=lambda p: str(p.relative_to(ROOT)))
def test_file_round_trips_byte_for_byte(path: Path, cli: Cli) -> None:
    text = path.read_text()
    flags = ["--split-input-file"] if "\n// -----\n" in text else []
    kept = cli("opt", "--keep-comments", *flags, str(path))
    assert kept.code == 0, kept.err
    assert kept.out == text
    canonical = cli("opt", *flags, str(path))
    again = cli("opt", *flags, "-", stdin=canonical.out)
    assert again.code == 0, again.err
    assert again.out == canonical.out


@pytest.mark.parametrize("path", VALID_QIR, ids=lambda p: str(p.relative_to(ROOT)))
def test_parse_print_is_structurally_equal(path: Path) -> None:
    for chunk in split_input(path.read_text()):
        m = parse_module(chunk.text, str(path), chunk.first_line)
        assert modules_equal(parse_module(print_module(m)), m)
        assert print_module(m, keep_comments=True) == chunk.text


def test_example_module_round_trips() -> None:
    m = tiny_llama()
    verify_module(m, data=True)
    text = print_module(m)
    back = parse_module(text)
    verify_module(back)
    assert modules_equal(back, m)
    assert print_module(back) == text


def test_structural_equality_sees_differences() -> None:
    m = tiny_llama()
    other = parse_module(print_module(m).replace("eps = 1e-06", "eps = 1e-05", 1))
    assert not modules_equal(other, m)


# --------------------------------------------------------------------------- random types

FLOATS = [DTYPES[n] for n in ("f32", "f16", "bf16")]
dims = st.integers(1, 300)


@st.composite
def quant_types(draw: st.DrawFn) -> QuantType:
    n, k = draw(dims), draw(dims)
    bits = draw(st.integers(1, 8))
    signed = draw(st.booleans())
    code = CodeDType(signed, bits)
    lo = draw(st.integers(code.min, code.max))
    hi = draw(st.integers(lo, code.max))
    group = draw(
        st.one_of(st.none(), st.builds(GroupSpec, st.just(1), st.integers(1, 512), st.sampled_from(["partial", "pad"])))
    )
    qshape = (n, -(-k // group.size)) if group else (1, 1)
    qparams = [("scale", DenseType(draw(st.sampled_from(FLOATS)), qshape))]
    if draw(st.booleans()):
        qparams.append(("zero", DenseType(DTYPES["u8"], qshape)))
    rate = draw(st.one_of(st.none(), st.builds(RateClaim, st.integers(0, 10**9), st.integers(1, 10**6))))
    return QuantType(
        family="affine",
        code=CodeContract(code, Alphabet.range(lo, hi), rev=draw(st.integers(1, 3))),
        expressed=DenseType(draw(st.sampled_from(FLOATS)), (n, k)),
        group=group,
        qparams=tuple(qparams),
        perm=DenseType(DTYPES["i32"], (k,)) if draw(st.booleans()) and group else None,
        pack=PackSpec(tile=(1, 1)),
        req=draw(st.sampled_from(["any", "linear", "embedding"])),
        rate=rate,
    )


@settings(max_examples=200, deadline=None)
@given(quant_types())
def test_random_quant_types_round_trip(t: QuantType) -> None:
    assert parse_type(str(t)) == t


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.one_of(dims, st.sampled_from(["?", "?seq", "?batch"])), max_size=5),
    st.sampled_from(list(DTYPES.values())),
)
def test_random_dense_types_round_trip(shape: list[int | str], dtype: object) -> None:
    t = DenseType(dtype, tuple(shape))  # type: ignore[arg-type]
    assert parse_type(str(t)) == t
