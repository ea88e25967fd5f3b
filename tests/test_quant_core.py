"""Quantization core: scheme strings, RTN affine quantization, the reference decoders and their golden
vectors, and a peer check of the decode contract against torchao."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from qcompiler.errors import QcError
from qcompiler.ir import QuantType, parse_type
from qcompiler.ir.families import Family
from qcompiler.ir.reference import DECODERS, DecodeError, Parts, decode, decoder
from qcompiler.quant.rtn import AffineQuant, QuantizeError, quantize_weight
from qcompiler.quant.schemes import Scheme, SchemeError, grammar, parse_scheme

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = sorted((ROOT / "golden" / "affine").glob("*.npz"))


def load_generator() -> ModuleType:
    """golden/make_golden.py (not a package): its loader, its cases and its scalar oracle."""
    spec = importlib.util.spec_from_file_location("qc_golden_make_golden", ROOT / "golden" / "make_golden.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


GEN = load_generator()


def qtype(text: str) -> QuantType:
    t = parse_type(text)
    assert isinstance(t, QuantType)
    return t


def bits_of(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The raw bytes of an array, so -0.0 != 0.0 and NaN payloads count."""
    return np.ascontiguousarray(a).view(np.uint8)


def affine_type(q: AffineQuant) -> QuantType:
    """The logical-layout descriptor of an ``AffineQuant`` (f32 output, int8 zero points)."""
    n, k = q.shape
    bits = int(np.log2(q.qmax - q.qmin + 1))
    groups = q.scale.shape[1]
    zero = "" if q.zero is None else f", zero: i8[{n},{groups}]"
    return qtype(
        f"!q.affine<i{bits}[{q.qmin}:{q.qmax}] -> f32[{n},{k}], group=(axis=1, size={q.group}, tail=partial), "
        f"qparams={{scale: f32[{n},{groups}]{zero}}}>"
    )


def affine_parts(q: AffineQuant) -> dict[str, np.ndarray[Any, Any]]:
    parts = {"codes": q.codes.numpy(), "scale": q.scale.numpy()}
    if q.zero is not None:
        parts["zero"] = q.zero.numpy()
    return parts


# ---------------------------------------------------------------------------------------------
# Schemes


@pytest.mark.parametrize(
    ("text", "bits", "group", "symmetric", "name"),
    [("w8-channel", 8, None, True, "w8-channel"), ("w8-g32", 8, 32, True, "w8-g32"),
     ("w4-g32", 4, 32, True, "w4-g32"), ("w4-g128-asym", 4, 128, False, "w4-g128-asym"),
     ("w2-g16-asym", 2, 16, False, "w2-g16-asym"), ("w4-g32-sym", 4, 32, True, "w4-g32"),
     ("w8-channel-asym", 8, None, False, "w8-channel-asym"), ("w4-g1", 4, 1, True, "w4-g1"),
     ("w2-g096", 2, 96, True, "w2-g96")],
)  # fmt: skip
def test_parse_scheme(text: str, bits: int, group: int | None, symmetric: bool, name: str) -> None:
    s = parse_scheme(text)
    assert s == Scheme(bits, group, symmetric)
    assert s.name == name == str(s)
    assert parse_scheme(s.name) == s
    assert (s.qmin, s.qmax) == {8: (-128, 127), 4: (-8, 7), 2: (-2, 1)}[bits]  # signed codes, sym or asym


def test_scheme_error_message_in_full() -> None:
    with pytest.raises(SchemeError) as info:
        parse_scheme("w3-g32")
    assert str(info.value) == (
        "invalid quantization scheme 'w3-g32': bit width must be 8, 4 or 2 (found 3); expected w{8,4,2}-channel "
        "or w{8,4,2}-g{G} (G a positive integer), optionally followed by -sym (default) or -asym, then optionally "
        "-clip (clipping search); e.g. w8-channel, w8-g32, w4-g32, w4-g128-asym, w2-g16-asym, w4-g32-clip; "
        "or a ggml block type quantized as llama.cpp does: q8_0, q4_0, q5_0"
    )
    assert isinstance(info.value, QcError)


@pytest.mark.parametrize(
    ("text", "what"),
    [("", "the scheme is empty"), ("w16-channel", "bit width must be 8, 4 or 2 (found 16)"),
     ("x8-g32", "bit width part must be w8, w4 or w2 (found 'x8')"),
     ("W8-g32", "bit width part must be w8, w4 or w2 (found 'W8')"),
     ("w-g32", "bit width part must be w8, w4 or w2 (found 'w')"),
     ("w8", "missing grouping part (channel or g{G})"),
     ("w8-", "grouping part must be channel or g{G} (found '')"),
     ("w8-k32", "grouping part must be channel or g{G} (found 'k32')"),
     ("w8-g-32", "grouping part must be channel or g{G} (found 'g')"),
     ("w4-g32 ", "grouping part must be channel or g{G} (found 'g32 ')"),
     ("w8-g0", "group size must be a positive integer (found 0)"),
     ("w4-g32-asymm", "symmetry suffix must be sym or asym (found 'asymm')"),
     ("w4-g32-", "symmetry suffix must be sym or asym (found '')"),
     ("w4-g32-asym-x", "unexpected trailing part 'x'")],
)  # fmt: skip
def test_malformed_schemes(text: str, what: str) -> None:
    with pytest.raises(SchemeError) as info:
        parse_scheme(text)
    assert str(info.value) == f"invalid quantization scheme {text!r}: {what}; expected {grammar()}"


def test_scheme_fields_are_checked() -> None:
    with pytest.raises(SchemeError, match=r"bits=3: bit width must be 8, 4 or 2"):
        Scheme(3, None)
    with pytest.raises(SchemeError, match=r"group=0: group size must be a positive integer"):
        Scheme(4, 0)


# ---------------------------------------------------------------------------------------------
# RTN quantization


def test_rtn_small_example() -> None:
    q = quantize_weight(torch.tensor([[1.0, -0.5, 0.0, 0.25, -1.0]]), parse_scheme("w8-channel"))
    assert q.scale.item() == np.float32(1.0) / np.float32(127.5)
    assert q.codes.tolist() == [[127, -64, 0, 32, -127]]  # 1/scale rounds to 127.49999
    assert (q.zero, q.group) == (None, 5)
    a = quantize_weight(torch.tensor([[1.0, -0.5, 0.0, 0.25, 3.0]]), parse_scheme("w4-g32-asym"))
    assert (a.codes.tolist(), a.zero.tolist() if a.zero is not None else None) == ([[-2, -8, -6, -5, 7]], [[-6]])


def test_rtn_tail_group_and_all_zero_groups() -> None:
    w = torch.zeros(2, 70)
    w[1, :40] = torch.linspace(-1, 1, 40)
    for text in ("w4-g32", "w4-g32-asym"):
        q = quantize_weight(w, parse_scheme(text))
        assert (q.scale.shape, q.codes.shape, q.codes.dtype) == ((2, 3), (2, 70), torch.int8)
        assert [*q.scale[0].tolist(), q.scale[1, 2].item()] == [2.0**-20] * 4
        assert torch.equal(q.dequantize()[0], torch.zeros(70))
        if q.zero is not None:
            assert q.zero[0].tolist() == [q.qmin] * 3


@pytest.mark.parametrize(
    ("w", "message"),
    [(torch.tensor([[0.0, 1.0], [2.0, torch.nan]]), r"^weight\[1, 1\] is not finite \(found nan\); cannot quantize$"),
     (torch.tensor([[-torch.inf, 1.0]]), r"^weight\[0, 0\] is not finite \(found -inf\)"),
     (torch.zeros(4), r"^weight must be 2-D \[N, K\] \(found shape \[4\]\)$"),
     (torch.zeros(2, 3, dtype=torch.int32), r"^weight must be a float tensor \(found torch.int32\)$"),
     (torch.zeros(0, 3), r"^weight must not be empty"),
     (torch.tensor([[3e38, -3e38]]), r"^weight row 0, group 0: range overflows float32 \(scale inf\)$")],
)  # fmt: skip
def test_rtn_rejects(w: torch.Tensor, message: str) -> None:
    with pytest.raises(QuantizeError, match=message):
        quantize_weight(w, parse_scheme("w8-channel-asym"))


@pytest.mark.parametrize("text", ["w4-g32", "w4-g32-asym", "w8-channel-clip", "w2-g16-asym-clip"])
def test_rtn_by_row_blocks_is_the_whole_tensor_pass(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """A block of rows at a time gives the codes and scales of one pass over the whole weight, and an
    error in a later block names its row in the weight."""
    from qcompiler.quant import rtn

    w = torch.randn(37, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    scheme = parse_scheme(text)
    monkeypatch.setattr(rtn, "BLOCK_ELEMENTS", 1 << 30)
    whole = quantize_weight(w, scheme, torch.bfloat16)
    monkeypatch.setattr(rtn, "BLOCK_ELEMENTS", 200)  # a few rows a block, the last block short
    blocked = quantize_weight(w, scheme, torch.bfloat16)
    assert torch.equal(whole.codes, blocked.codes)
    assert torch.equal(whole.scale, blocked.scale)
    assert whole.scale.dtype == torch.bfloat16
    assert (whole.zero is None and blocked.zero is None) or torch.equal(whole.zero, blocked.zero)  # pyright: ignore[reportArgumentType]
    w[30, 5] = torch.nan
    with pytest.raises(QuantizeError, match=r"^weight\[30, 5\] is not finite"):
        quantize_weight(w, scheme)


@st.composite
def weight_and_scheme(draw: st.DrawFn) -> tuple[torch.Tensor, Scheme]:
    scheme = Scheme(draw(st.sampled_from([8, 4, 2])), draw(st.none() | st.integers(1, 40)), draw(st.booleans()))
    shape = (draw(st.integers(1, 5)), draw(st.integers(1, 80)))
    elements = st.just(0.0) | st.floats(-1.0, 1.0, width=32)
    values = draw(arrays(np.float32, shape, elements=elements))
    magnitude = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]))
    return torch.from_numpy(values) * magnitude, scheme


def expand(q: AffineQuant, t: torch.Tensor) -> torch.Tensor:
    return t.index_select(1, torch.arange(q.shape[1]) // q.group)


@settings(max_examples=150, deadline=None)
@given(weight_and_scheme())
def test_rtn_properties(case: tuple[torch.Tensor, Scheme]) -> None:
    w, scheme = case
    q = quantize_weight(w, scheme)
    n, k = w.shape
    groups = -(-k // (k if scheme.group is None else scheme.group))
    assert (q.codes.dtype, q.codes.shape) == (torch.int8, (n, k))
    assert (q.scale.dtype, q.scale.shape) == (torch.float32, (n, groups))
    assert (q.zero is None) == scheme.symmetric
    assert scheme.qmin <= int(q.codes.min()) <= int(q.codes.max()) <= scheme.qmax
    assert bool(((q.scale > 0) & torch.isfinite(q.scale)).all())
    deq = q.dequantize()
    scale = expand(q, q.scale).double()
    zero = torch.zeros_like(scale) if q.zero is None else expand(q, q.zero).double()
    err = (deq.double() - w.double()).abs()
    # Where w / scale + zero rounds into [qmin, qmax] nothing is clipped: the error is at most half a step.
    u = w.double() / scale + zero
    inside = (u >= scheme.qmin - 0.5 - 2**-10) & (u <= scheme.qmax + 0.5 + 2**-10)
    assert bool((err[inside] <= scale[inside] * (0.5 + 2**-9)).all())
    assert bool((err <= scale * (1 + 2**-9)).all())  # asymmetric zero rounding clips by at most half a step more
    if scheme.symmetric:
        assert bool(inside.all())
    # The codes are a fixed point of the rounding step under their own qparams.
    again = torch.clamp(torch.round(deq / expand(q, q.scale)) + zero.float(), scheme.qmin, scheme.qmax)
    assert torch.equal(again.to(torch.int8), q.codes)
    # The reference decoder is bit-exact with dequantize().
    got = decode(affine_type(q), affine_parts(q))
    assert np.array_equal(got.view(np.int32), deq.numpy().view(np.int32))


def test_symmetric_rtn_is_not_idempotent() -> None:
    """amax / ((qmax - qmin) / 2) (torchao's symmetric rule) leaves the top code at 127 = amax/scale - 0.5,
    so quantizing the dequantized weight again shrinks the scale by 127/127.5. Pinned so nobody relies on it."""
    q1 = quantize_weight(torch.tensor([[1.0, -0.25]]), parse_scheme("w8-channel"))
    q2 = quantize_weight(q1.dequantize(), parse_scheme("w8-channel"))
    assert q2.scale.item() == np.float32(np.float32(127 * q1.scale.item()) / np.float32(127.5))
    assert q2.scale.item() < q1.scale.item()


# ---------------------------------------------------------------------------------------------
# Reference decoders and golden vectors


def load_golden(path: Path) -> tuple[QuantType, Parts, np.ndarray[Any, Any]]:
    text, parts, expected = GEN.load(path)
    t = qtype(text)
    assert str(t) == text
    return t, parts, expected


def test_golden_set_is_complete_and_small() -> None:
    names = {p.stem for p in GOLDEN}
    for bits in range(2, 9):
        assert {f"alphabet_i{bits}", f"alphabet_u{bits}"} <= names
    assert {"k7_channel", "k70_g32_partial", "perm_axis1_g4", "nested_two_level", "ternary_g8"} <= names
    assert {"mixed_exceptions", "per_tensor", "bits_i8", "bits_u8", "zero_extremes_i8"} <= names
    assert sum(p.stat().st_size for p in GOLDEN) < 200 * 1024
    families = {load_golden(p)[0].family for p in GOLDEN}
    assert families == {"affine", "nested", "ternary", "mixed"}


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_reference_matches_golden(path: Path) -> None:
    t, parts, expected = load_golden(path)
    got = decode(t, parts)
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
    assert np.array_equal(bits_of(got), bits_of(expected))


def test_golden_files_match_their_generator() -> None:
    cases = GEN.all_cases()
    assert sorted(name for name, _, _ in cases) == sorted(p.stem for p in GOLDEN)
    for name, _, spec in cases:
        t, _, expected = load_golden(ROOT / "golden" / "affine" / f"{name}.npz")
        assert str(qtype(spec.text())) == str(t)
        assert np.array_equal(bits_of(GEN.oracle(spec)), bits_of(expected)), name


def test_decoder_table_covers_every_family() -> None:
    assert {("affine", 1), ("nested", 1), ("ternary", 1), ("mixed", 1)} <= set(DECODERS)
    for name, family in Family.registry.items():
        for version in family.decoders:
            assert (name, version) in DECODERS, f"{name} v{version} has no reference decoder"
    with pytest.raises(TypeError, match="reference decoder affine v1 registered twice"):
        decoder("affine", 1)(DECODERS["affine", 1])


MIXED = (
    "!q.mixed<i4[-8:7] -> f32[2,4], group=(axis=1, size=4, tail=partial), qparams={scale: f32[2,1]}, "
    "exceptions={index: i32[2], value: f16[2]}>"
)
NESTED = (
    "!q.nested<u4[0:15] -> f32[2,8], group=(axis=1, size=4, tail=partial), qparams={scale: !q.affine<u6[0:63] "
    "-> f32[2,2], qparams={scale: f16[1,1]}, req=qparam>}>"
)
MIXED_PARTS: dict[str, Any] = {"codes": np.zeros((2, 4), np.int8), "scale": np.ones((2, 1), np.float32)}
MIXED_PARTS["value"] = np.ones(2, np.float16)
SUB_PARTS = {"codes": np.zeros((2, 2), np.uint8), "scale": np.ones((1, 1), np.float16)}
A4 = "!q.affine<i4[-8:7] -> f32[2,8], group=(axis=1, size=4, tail=partial), qparams={scale: f32[2,2]}"


def a4_parts(**changes: Any) -> dict[str, Any]:
    parts: dict[str, Any] = {"codes": np.zeros((2, 8), np.int8), "scale": np.ones((2, 2), np.float32)}
    parts.update(changes)
    return {k: v for k, v in parts.items() if v is not None}


@pytest.mark.parametrize(
    ("text", "parts", "message"),
    [
        (A4 + ", decoder=2>", a4_parts(),
         "decoder: no reference decoder for this family and version (expected affine v1, f8e4m3 v1, mixed v1, "
         "mixprec v1, nested v1, ternary v1, found affine v2)"),
        (A4 + ">", a4_parts(scale=None), "scale: missing part (expected codes, scale, found codes)"),
        (A4 + ">", a4_parts(zero=np.zeros((2, 2), np.int8)),
         "zero: unknown part for this descriptor (expected codes, scale, found zero)"),
        (A4 + ">", a4_parts(codes=np.zeros((2, 8), np.int16)), "codes: wrong dtype (expected int8, found int16)"),
        (A4 + ">", a4_parts(codes=np.zeros((2, 7), np.int8)), "codes: wrong shape (expected [2,8], found [2,7])"),
        (A4 + ">", a4_parts(codes=np.full((2, 8), 9, np.int8)),
         "codes[0,0]: code outside the alphabet (expected [-8:7], found 9)"),
        (A4 + ">", a4_parts(scale=np.ones((2, 2), np.float16)),
         "scale: wrong dtype for f32 (expected float32, found float16)"),
        (A4 + ">", a4_parts(scale=np.ones((2, 3), np.float32)), "scale: wrong shape (expected [2,2], found [2,3])"),
        (A4 + ">", a4_parts(scale=[[1.0, 1.0]] * 2),
         "scale: part must be a numpy array (expected numpy.ndarray, found list)"),
        (A4 + ", perm=i32[8]>", a4_parts(perm=np.zeros(8, np.int32)),
         "perm: not a permutation of the group axis (expected a permutation of 0..7, found [0, 0, 0, 0, 0, 0, 0, 0])"),
        (A4 + ", unit=vector2>", a4_parts(),
         "descriptor: reference decoders read the logical layout of element codes (expected pack logical v1, "
         "unit=element, rev=1, found pack logical v1, unit=vector2, rev=1)"),
        (A4.replace("f32[2,2]", "f32[2,3]") + ">", a4_parts(scale=np.ones((2, 3), np.float32)),
         "descriptor: qparam 'scale': shape must be the tensor shape with ceil(K/G) along the group axis "
         "(expected [2,2], found [2,3])"),
        (A4 + ", transforms={rotation: f32[8,8]}>", a4_parts(rotation=np.eye(8, dtype=np.float32)),
         "rotation: affine v1 defines no decode for a rotation transform (expected no transforms, found rotation)"),
        (MIXED, MIXED_PARTS | {"index": np.array([3, 8], np.int32)},
         "index[1]: exception index outside the tensor (expected in [0, 7], found 8)"),
        (MIXED, MIXED_PARTS | {"index": np.array([3, 3], np.int32)},
         "index[1]: exception indices must be strictly increasing (expected > 3, found 3)"),
        (NESTED, {"codes": np.zeros((2, 8), np.uint8), "scale": np.ones((2, 2), np.float32)},
         "scale: a quantized qparam needs a dict of its parts (expected dict, found numpy.ndarray)"),
        (NESTED, {"codes": np.zeros((2, 8), np.uint8), "scale": SUB_PARTS | {"codes": np.zeros((2, 2), np.int8)}},
         "scale.codes: wrong dtype (expected uint8, found int8)"),
    ],
)  # fmt: skip
def test_decode_errors(text: str, parts: Parts, message: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode(qtype(text), parts)
    assert str(info.value) == message
    assert isinstance(info.value, QcError)


# ---------------------------------------------------------------------------------------------
# Peer: torchao's dequantize_affine computes the same contract


@pytest.fixture(scope="module")
def torchao_primitives() -> Any:
    return pytest.importorskip("torchao.quantization.quant_primitives")


PEER_CASES = [
    ("u4[0:15]", 32, 0, 15, True, torch.float32, torch.float32),  # torchao's own int4 convention
    ("i4[-8:7]", 32, -8, 7, True, torch.float32, torch.float32),
    ("i8[-128:127]", 96, -128, 127, False, torch.float32, torch.float32),  # per-channel
    ("i4[-8:7]", 32, -8, 7, True, torch.float16, torch.float16),
    ("i8[-128:127]", 32, -128, 127, True, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("case", PEER_CASES, ids=lambda c: f"{c[0]}-g{c[1]}-{c[6]}")
def test_reference_matches_torchao_dequantize_affine(torchao_primitives: Any, case: tuple[Any, ...]) -> None:
    """torchao builds codes and qparams its own way (int32 zero points, its rounding); we decode them."""
    qp = torchao_primitives
    head, block, qmin, qmax, asym, scale_dtype, out_dtype = case
    gen = torch.Generator().manual_seed(block + qmin)
    w = torch.randn(24, 96, generator=gen) * torch.logspace(-3, 2, 24).unsqueeze(1)
    codes_dtype = torch.uint8 if head.startswith("u") else torch.int8
    mapping = qp.MappingType.ASYMMETRIC if asym else qp.MappingType.SYMMETRIC
    scale, zero = qp.choose_qparams_affine(w, mapping, (1, block), codes_dtype, qmin, qmax, scale_dtype=scale_dtype)
    codes = qp.quantize_affine(w, (1, block), scale, zero, codes_dtype, qmin, qmax)
    peer = qp.dequantize_affine(codes, (1, block), scale, zero, codes_dtype, qmin, qmax, output_dtype=out_dtype)
    sdt = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    groups = 96 // block
    t = qtype(
        f"!q.affine<{head} -> {sdt[out_dtype]}[24,96], group=(axis=1, size={block}, tail=partial), "
        f"qparams={{scale: {sdt[scale_dtype]}[24,{groups}], zero: i32[24,{groups}]}}>"
    )
    scale_np = scale.view(torch.int16).numpy().view(np.uint16) if scale_dtype == torch.bfloat16 else scale.numpy()
    parts = {"codes": codes.numpy(), "scale": scale_np.reshape(24, groups), "zero": zero.numpy().reshape(24, groups)}
    got = decode(t, parts)
    want = peer.float().numpy() if out_dtype == torch.bfloat16 else peer.numpy()
    assert got.dtype == want.dtype
    assert np.array_equal(bits_of(got), bits_of(want))


def test_rtn_agrees_with_torchao_qparams(torchao_primitives: Any) -> None:
    """Same scales and zero points as torchao's choose_qparams_affine; codes differ by at most one step
    where torchao rounds ``w * (1 / scale)`` and we round ``w / scale``."""
    qp = torchao_primitives
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7))
    for text, asym in (("w4-g32", False), ("w4-g32-asym", True), ("w8-channel", False)):
        q = quantize_weight(w, parse_scheme(text))
        mapping = qp.MappingType.ASYMMETRIC if asym else qp.MappingType.SYMMETRIC
        block = (1, q.group)
        scale, zero = qp.choose_qparams_affine(w, mapping, block, torch.int8, q.qmin, q.qmax)
        codes = qp.quantize_affine(w, block, scale, zero, torch.int8, q.qmin, q.qmax)
        assert torch.equal(q.scale, scale.reshape(q.scale.shape))
        if q.zero is not None:
            assert torch.equal(q.zero.to(torch.int32), zero.reshape(q.zero.shape))
        assert int((q.codes.int() - codes.int()).abs().max()) <= 1


@pytest.mark.parametrize("text", ["w4-g32-clip", "w4-g32-asym-clip", "w2-g16-asym-clip", "w8-channel-clip"])
def test_clipping_search_lowers_error_and_keeps_the_contract(text: str) -> None:
    s = parse_scheme(text)
    assert s.clip
    assert s.name == text.replace("-sym", "")
    plain = Scheme(s.bits, s.group, s.symmetric)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 96, generator=gen)
    w[3, 5] = 9.0  # an outlier the search may clip
    q_clip, q_plain = quantize_weight(w, s), quantize_weight(w, plain)
    err_clip = float(((q_clip.dequantize() - w) ** 2).sum())
    err_plain = float(((q_plain.dequantize() - w) ** 2).sum())
    assert err_clip <= err_plain
    assert int(q_clip.codes.min()) >= s.qmin
    assert int(q_clip.codes.max()) <= s.qmax
    if s.bits < 8:
        assert err_clip < 0.97 * err_plain
