"""Regenerate the reference-decode vectors in golden/affine/ (run: ``python golden/make_golden.py``).

Each ``golden/affine/NAME.npz`` holds:

- ``meta``: a JSON string ``{"name", "note", "descriptor"}``; ``descriptor`` is ``str(QuantType)``,
  readable with ``qcompiler.ir.parse_type``;
- ``codes`` and one array per slot of the descriptor, in the IR's in-memory dtypes (``bf16`` as raw
  ``uint16`` bits); a nested (quantized) slot ``scale`` is stored as ``scale.codes``, ``scale.scale``...;
- ``expected``: the decoded tensor (float32 for f32 and bf16, float16 for f16, float64 for f64).

``expected`` is computed here by the plainest scalar loop, one element at a time with numpy float32
scalar arithmetic (bf16 rounding via torch), independently of ``qcompiler.ir.reference``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from qcompiler.ir import QuantType, parse_type
from qcompiler.ir.descriptor import check_descriptor

Array = npt.NDArray[Any]
Dense = tuple[str, Array]
"""A dense slot: its IR dtype name and its values in that dtype's numpy container."""

OUT = Path(__file__).resolve().parent / "affine"
FLOAT_CONTAINERS = {"f32": np.float32, "f16": np.float16, "f64": np.float64}
INT_CONTAINERS = {"i8": np.int8, "u8": np.uint8, "i32": np.int32, "i64": np.int64}


@dataclass
class Spec:
    """One quantized tensor: descriptor pieces plus the arrays that bind its parts."""

    family: str
    head: str
    expressed: str
    codes: Array
    group: tuple[int, int, str] | None = None
    qparams: dict[str, Dense | Spec] = field(default_factory=lambda: {})
    exceptions: dict[str, Dense] = field(default_factory=lambda: {})
    perm: Dense | None = None
    req: str = "any"

    def text(self) -> str:
        """The descriptor text (non-canonical; ``parse_type`` canonicalises it)."""
        fields = [f"{self.head} -> {self.expressed}{_shape(self.codes)}"]
        if self.group is not None:
            axis, size, tail = self.group
            fields.append(f"group=(axis={axis}, size={size}, tail={tail})")
        fields.append("qparams={" + ", ".join(f"{n}: {_slot_text(v)}" for n, v in self.qparams.items()) + "}")
        if self.exceptions:
            fields.append("exceptions={" + ", ".join(f"{n}: {_slot_text(v)}" for n, v in self.exceptions.items()) + "}")
        if self.perm is not None:
            fields.append(f"perm={_slot_text(self.perm)}")
        tile = ",".join("1" for _ in self.codes.shape)
        fields.append(f"pack=(family=logical, version=1, encoding=none, tile=[{tile}])")
        fields.append(f"req={self.req}")
        return f"!q.{self.family}<{', '.join(fields)}>"

    def arrays(self, prefix: str = "") -> dict[str, Array]:
        """Every part, keyed ``codes``, ``scale``, ``scale.codes`` (nested) ..."""
        out: dict[str, Array] = {prefix + "codes": self.codes}
        for name, slot in {**self.qparams, **self.exceptions}.items():
            out.update(slot.arrays(f"{prefix}{name}.") if isinstance(slot, Spec) else {prefix + name: slot[1]})
        if self.perm is not None:
            out[prefix + "perm"] = self.perm[1]
        return out


def _shape(a: Array) -> str:
    return "[" + ",".join(str(d) for d in a.shape) + "]"


def _slot_text(slot: Dense | Spec) -> str:
    return slot.text() if isinstance(slot, Spec) else f"{slot[0]}{_shape(slot[1])}"


# ---------------------------------------------------------------------------------------------
# The independent scalar oracle.


def bf16_bits(values: list[float] | Array) -> Array:
    """float values -> raw bfloat16 bits (uint16), rounded by torch."""
    t = torch.tensor(np.asarray(values, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def dense(dtype: str, values: Any) -> Dense:
    """A dense slot of IR dtype ``dtype`` holding ``values``."""
    if dtype == "bf16":
        return dtype, bf16_bits(np.asarray(values, dtype=np.float64).astype(np.float32))
    kind = FLOAT_CONTAINERS.get(dtype) or INT_CONTAINERS[dtype]
    return dtype, np.asarray(values).astype(kind)


def _value(dtype: str, arr: Array, idx: tuple[int, ...]) -> float:
    v = arr[idx] if arr.ndim else arr[()]
    if dtype == "bf16":
        return struct.unpack("<f", struct.pack("<I", int(v) << 16))[0]
    return float(v)


def _cast(v: np.float32, dtype: str) -> float:
    if dtype == "f16":
        with np.errstate(over="ignore"):
            return float(np.float16(v))
    if dtype == "bf16":
        return torch.tensor(float(v), dtype=torch.float32).to(torch.bfloat16).item()
    return float(v)


def oracle(s: Spec) -> Array:
    """Decode ``s`` one element at a time (see the module docstring)."""
    rank = s.codes.ndim
    axis = s.group[0] if s.group is not None else rank - 1
    slots: dict[str, Dense] = {}
    for name, slot in s.qparams.items():
        slots[name] = ("f64", oracle(slot).astype(np.float64)) if isinstance(slot, Spec) else slot
    out = np.zeros(s.codes.shape, dtype=np.float32)
    for idx in np.ndindex(*s.codes.shape):
        gidx = tuple(0 for _ in idx)
        if s.group is not None:
            gidx = tuple(i // s.group[1] if d == axis else i for d, i in enumerate(idx))
        code = int(s.codes[idx])
        scale = _value(*slots["scale"], gidx)
        if s.family == "nested":
            v = np.float32(np.float32(scale) * np.float32(code))
            if "min" in slots:
                v = np.float32(v - np.float32(_value(*slots["min"], gidx)))
        else:
            zero = _value(*slots["zero"], gidx) if "zero" in slots else 0.0
            v = np.float32(np.float32(code - zero) * np.float32(scale))
        dst = idx
        if s.perm is not None:
            dst = tuple(int(s.perm[1][i]) if d == axis else i for d, i in enumerate(idx))
        out[dst] = v
    if s.exceptions:
        index, value = s.exceptions["index"], s.exceptions["value"]
        for i in range(index[1].shape[0]):
            out.reshape(-1)[int(index[1][i])] = np.float32(_value(value[0], value[1], (i,)))
    kind = {"f16": np.float16, "f64": np.float64}.get(s.expressed, np.float32)
    result = np.zeros(s.codes.shape, dtype=kind)
    for idx in np.ndindex(*s.codes.shape):
        result[idx] = _cast(np.float32(out[idx]), s.expressed)
    return result


# ---------------------------------------------------------------------------------------------
# The cases.

RNG = np.random.default_rng(20240607)


def codes_in(lo: int, hi: int, shape: tuple[int, ...], signed: bool) -> Array:
    """Random codes in ``[lo, hi]`` in the logical container (int8 / uint8)."""
    return RNG.integers(lo, hi + 1, size=shape).astype(np.int8 if signed else np.uint8)


def scales(shape: tuple[int, ...]) -> Array:
    """Random positive scales of varied magnitude (not powers of two)."""
    return (RNG.uniform(0.5, 2.0, size=shape) * 10.0 ** RNG.integers(-4, 2, size=shape)).astype(np.float32)


def alphabet_cases() -> list[tuple[str, str, Spec]]:
    """Every code of every width 2..8, signed (no zero) and unsigned (mid zero point)."""
    out: list[tuple[str, str, Spec]] = []
    for bits in range(2, 9):
        n = 1 << bits
        lo, hi = -(n // 2), n // 2 - 1
        row = np.arange(lo, hi + 1)
        codes = np.stack([row, row[::-1]]).astype(np.int8)
        group = max(n // 4, 1)
        sig = Spec("affine", f"i{bits}[{lo}:{hi}]", "f32", codes, (1, group, "partial"),
                   {"scale": dense("f32", scales((2, n // group)))})  # fmt: skip
        out.append((f"alphabet_i{bits}", f"every signed {bits}-bit code, min and max, symmetric", sig))
        urow = np.arange(0, n)
        ucodes = np.stack([urow, urow[::-1]]).astype(np.uint8)
        zero = np.full((2, n // group), n // 2, dtype=np.uint8)
        uns = Spec("affine", f"u{bits}[0:{n - 1}]", "f32", ucodes, (1, group, "partial"),
                   {"scale": dense("f32", scales((2, n // group))), "zero": dense("u8", zero)})  # fmt: skip
        out.append((f"alphabet_u{bits}", f"every unsigned {bits}-bit code with a mid zero point", uns))
    return out


def bit_cases() -> list[tuple[str, str, Spec]]:
    """Codes that set each single bit (plus 0 and all-ones), per-tensor qparams."""
    i8 = np.array([[1, 2, 4, 8, 16, 32, 64, -128, 0, -1]], dtype=np.int8)
    u8 = np.array([[1, 2, 4, 8, 16, 32, 64, 128, 0, 255]], dtype=np.uint8)
    i4 = np.array([[1, 2, 4, -8, 0, -1]], dtype=np.int8)
    sc = np.array([[0.3]], dtype=np.float32)
    mant = 1.0 + 2.0 ** -np.arange(1, 24, dtype=np.float64)
    mant_codes = np.tile(np.array([1, 3, -5, 127], dtype=np.int8), (23, 1))
    return [
        ("bits_i8", "each bit of a signed byte code, per-tensor [1,1] scale",
         Spec("affine", "i8[-128:127]", "f32", i8, None, {"scale": dense("f32", sc)})),
        ("bits_u8", "each bit of an unsigned byte code, per-tensor scalar scale and zero",
         Spec("affine", "u8[0:255]", "f32", u8, None, {"scale": dense("f32", np.float32(0.3)),
                                                       "zero": dense("u8", np.uint8(0))})),
        ("bits_i4", "each bit of a signed 4-bit code",
         Spec("affine", "i4[-8:7]", "f32", i4, None, {"scale": dense("f16", np.array([[0.125]]))})),
        ("scale_mantissa_bits", "scales 1+2^-i (each mantissa bit) times odd codes: product rounding",
         Spec("affine", "i8[-128:127]", "f32", mant_codes, (1, 4, "partial"),
              {"scale": dense("f32", (mant * 3.0).reshape(23, 1))})),
    ]  # fmt: skip


def grouping_cases() -> list[tuple[str, str, Spec]]:
    """Odd K, tail groups, per-channel on either axis, per-tensor, rank 3."""

    def aff(head: str, codes: Array, group: tuple[int, int, str] | None, qp: dict[str, Dense | Spec]) -> Spec:
        return Spec("affine", head, "f32", codes, group, qp)

    i4, i8 = "i4[-8:7]", "i8[-128:127]"
    return [
        ("k7_channel", "odd K=7, per-channel (one group spans K)",
         aff(i8, codes_in(-128, 127, (3, 7), True), (1, 7, "partial"), {"scale": dense("f32", scales((3, 1)))})),
        ("k33_g8_zero_f16", "K=33, G=8: a tail group of 1; i8 zero points, f16 scales",
         aff(i4, codes_in(-8, 7, (2, 33), True), (1, 8, "partial"),
             {"scale": dense("f16", scales((2, 5))), "zero": dense("i8", codes_in(-8, 7, (2, 5), True))})),
        ("k70_g32_partial", "K=70, G=32, tail=partial (groups 32, 32, 6)",
         aff(i4, codes_in(-8, 7, (3, 70), True), (1, 32, "partial"), {"scale": dense("f32", scales((3, 3)))})),
        ("k70_g32_pad", "K=70, G=32, tail=pad: same decode, codes keep the logical shape",
         aff(i4, codes_in(-8, 7, (3, 70), True), (1, 32, "pad"), {"scale": dense("f32", scales((3, 3)))})),
        ("channel_axis0", "groups along axis 0: one group spans all 6 rows",
         aff(i8, codes_in(-128, 127, (6, 5), True), (0, 6, "partial"), {"scale": dense("f32", scales((1, 5)))})),
        ("axis0_g4_tail", "groups of 4 along axis 0 with a tail of 2, asymmetric",
         aff(i4, codes_in(-8, 7, (10, 3), True), (0, 4, "partial"),
             {"scale": dense("f32", scales((3, 3))), "zero": dense("i8", codes_in(-8, 7, (3, 3), True))})),
        ("per_tensor", "no group: one [1,1] scale and zero cover the whole tensor",
         aff("u8[0:255]", codes_in(0, 255, (4, 9), False), None,
             {"scale": dense("f32", scales((1, 1))), "zero": dense("u8", np.array([[131]]))})),
        ("rank3_axis2", "rank 3, groups of 4 along the last axis (tail 2)",
         aff(i4, codes_in(-8, 7, (2, 3, 10), True), (2, 4, "partial"), {"scale": dense("bf16", scales((2, 3, 3)))})),
    ]  # fmt: skip


def zero_cases() -> list[tuple[str, str, Spec]]:
    """Zero points at both ends of their range against codes at both ends."""
    out: list[tuple[str, str, Spec]] = []
    for head, lo, hi, zdt, signed in (("i4[-8:7]", -8, 7, "i8", True), ("i8[-128:127]", -128, 127, "i8", True),
                                      ("u8[0:255]", 0, 255, "u8", False)):  # fmt: skip
        row = [lo, hi, lo + 1, hi - 1, 0 if signed else 128]
        codes = np.array([row, row], dtype=np.int8 if signed else np.uint8)
        zero = np.array([[lo], [hi]])
        spec = Spec("affine", head, "f32", codes, (1, 5, "partial"),
                    {"scale": dense("f32", scales((2, 1))), "zero": dense(zdt, zero)})  # fmt: skip
        out.append((f"zero_extremes_{head[:2]}", f"zero points {lo} and {hi} with extreme codes", spec))
    return out


def perm_cases() -> list[tuple[str, str, Spec]]:
    """Act-order permutations: along axis 1, along axis 0, and per-tensor (last axis)."""
    p12 = RNG.permutation(12)
    p8 = RNG.permutation(8)
    p5 = RNG.permutation(5)
    return [
        ("perm_axis1_g4", "act-order perm i32[12], groups of 4 in stored order, asymmetric",
         Spec("affine", "i4[-8:7]", "f32", codes_in(-8, 7, (3, 12), True), (1, 4, "partial"),
              {"scale": dense("f32", scales((3, 3))), "zero": dense("i8", codes_in(-8, 7, (3, 3), True))},
              perm=dense("i32", p12))),
        ("perm_axis0_g4", "perm i64[8] along group axis 0",
         Spec("affine", "i8[-128:127]", "f32", codes_in(-128, 127, (8, 3), True), (0, 4, "partial"),
              {"scale": dense("f32", scales((2, 3)))}, perm=dense("i64", p8))),
        ("perm_per_tensor", "per-tensor with a perm along the last axis",
         Spec("affine", "i4[-8:7]", "f32", codes_in(-8, 7, (2, 5), True), None,
              {"scale": dense("f32", scales((1, 1)))}, perm=dense("i32", p5))),
    ]  # fmt: skip


def nested_cases() -> list[tuple[str, str, Spec]]:
    """K-quant style: sub-block scales and mins quantized against per-row super-block f16 qparams."""

    def sub(bits: int) -> Spec:
        hi = (1 << bits) - 1
        return Spec("affine", f"u{bits}[0:{hi}]", "f32", codes_in(0, hi, (3, 4), False), (1, 4, "partial"),
                    {"scale": dense("f16", scales((3, 1)))}, req="qparam")  # fmt: skip

    two_level = Spec("nested", "u4[0:15]", "f32", codes_in(0, 15, (3, 64), False), (1, 16, "partial"),
                     {"scale": sub(6), "min": sub(6)})  # fmt: skip
    dense_scale = Spec("nested", "i8[-128:127]", "f16", codes_in(-128, 127, (2, 40), True), (1, 16, "partial"),
                       {"scale": dense("f16", scales((2, 3)))})  # fmt: skip
    sub_f16 = Spec("affine", "i8[-128:127]", "f16", codes_in(-128, 127, (2, 2), True), None,
                   {"scale": dense("f32", np.array([[0.001]]))}, req="qparam")  # fmt: skip
    mixed_levels = Spec("nested", "u2[0:3]", "bf16", codes_in(0, 3, (2, 16), False), (1, 8, "partial"),
                        {"scale": sub_f16, "min": dense("bf16", scales((2, 2)))})  # fmt: skip
    order = Spec("nested", "i8[-128:127]", "f32", np.tile(np.array([3, 5, 7, 9], np.int8), (2, 2)), (1, 4, "partial"),
                 {"scale": dense("f32", 1.0 + np.array([[1, 3], [5, 7]]) * 2.0**-23),
                  "min": dense("f32", [[3.0, 5.0], [7.0, 9.0]])})  # fmt: skip
    return [
        ("nested_rounding_order", "scale*code rounds to f32 before min is subtracted (cancellation shows it)", order),
        ("nested_two_level", "u4 codes, u6 sub-scales and sub-mins, f16 super-scales", two_level),
        ("nested_dense_f16", "dense f16 scales, no min, f16 output", dense_scale),
        ("nested_f16_sub_bf16", "scale quantized to an f16-expressed sub-tensor, bf16 mins, bf16 output", mixed_levels),
    ]


def family_cases() -> list[tuple[str, str, Spec]]:
    """Ternary and mixed (exceptions)."""
    index = np.sort(RNG.choice(4 * 24, size=5, replace=False))
    return [
        ("ternary_g8", "codes in {-1,0,1}, groups of 8, f16 scales",
         Spec("ternary", "i2{-1,0,1}", "f32", codes_in(-1, 1, (4, 24), True), (1, 8, "partial"),
              {"scale": dense("f16", scales((4, 3)))})),
        ("ternary_bf16", "ternary with bf16 scales and bf16 output",
         Spec("ternary", "i2{-1,0,1}", "bf16", codes_in(-1, 1, (2, 20), True), (1, 8, "partial"),
              {"scale": dense("bf16", scales((2, 3)))})),
        ("mixed_exceptions", "i4 asymmetric codes plus 5 f16 outliers at flat indices (first and last too)",
         Spec("mixed", "i4[-8:7]", "f32", codes_in(-8, 7, (4, 24), True), (1, 8, "partial"),
              {"scale": dense("f32", scales((4, 3))), "zero": dense("i8", codes_in(-8, 7, (4, 3), True))},
              {"index": dense("i32", np.concatenate([[0], index[1:-1], [95]])),
               "value": dense("f16", RNG.normal(0, 50, size=5))})),
        ("mixed_i64_f32_to_f16", "i64 indices, f32 outlier values, f16 output (values rounded after)",
         Spec("mixed", "i8[-128:127]", "f16", codes_in(-128, 127, (3, 10), True), (1, 10, "partial"),
              {"scale": dense("f32", scales((3, 1)))},
              {"index": dense("i64", np.array([3, 17, 29])), "value": dense("f32", [1e-3, -7.0e4, 3.14159])})),
    ]  # fmt: skip


def dtype_cases() -> list[tuple[str, str, Spec]]:
    """Expressed-dtype edges: f16 overflow and subnormals, bf16 ties, f32 subnormals, signed zero, f64."""
    i8 = "i8[-128:127]"
    row = np.array([[127, -128, 1, 0, 2, -3, 64, 100]], dtype=np.int8)
    ties = np.tile(np.array([1, 2, 4, 8, 16, -32, 64, -128, 3, 127], dtype=np.int8), (2, 1))
    tiny = np.array([[2.0**-140, 1.5 * 2.0**-147]], dtype=np.float32)
    return [
        ("f16_overflow", "products beyond 65504 become inf in f16", Spec("affine", i8, "f16", row, None,
         {"scale": dense("f32", np.array([[700.0]]))})),
        ("f16_subnormal", "products in the f16 subnormal range", Spec("affine", i8, "f16", row, None,
         {"scale": dense("f32", np.array([[1.1e-7]]))})),
        ("bf16_ties", "scales 1+2^-8 and 1+3*2^-8 times powers of two: exact bf16 ties, rounding down and up",
         Spec("affine", i8, "bf16", ties, (1, 10, "partial"),
              {"scale": dense("f32", np.array([[1.0 + 2.0**-8], [1.0 + 3 * 2.0**-8]]))})),
        ("f32_subnormal", "products in the f32 subnormal range", Spec("affine", i8, "f32", np.tile(row, (2, 1)),
         (1, 8, "partial"), {"scale": dense("f32", tiny.reshape(2, 1))})),
        ("signed_zero", "negative scale: code - zero == 0 decodes to -0.0",
         Spec("affine", "i4[-8:7]", "f32", np.array([[0, 3, -2, 0]], dtype=np.int8), None,
              {"scale": dense("f32", np.array([[-0.5]]))})),
        ("f64_out", "f64 output is the f32 result widened", Spec("affine", i8, "f64", row, None,
         {"scale": dense("f32", np.array([[0.1]]))})),
    ]  # fmt: skip


def all_cases() -> list[tuple[str, str, Spec]]:
    """Every golden case, in file order."""
    return [*grouping_cases(), *alphabet_cases(), *bit_cases(), *zero_cases(), *perm_cases(), *nested_cases(),
            *family_cases(), *dtype_cases()]  # fmt: skip


def load(path: Path) -> tuple[str, dict[str, Any], Array]:
    """Read one vector: (descriptor text, parts with nested slots as dicts, expected decode)."""
    with np.load(path, allow_pickle=False) as z:
        descriptor = json.loads(str(z["meta"]))["descriptor"]
        expected = z["expected"]
        parts: dict[str, Any] = {}
        for key in z.files:
            if key in ("meta", "expected"):
                continue
            *outer, last = key.split(".")
            node = parts
            for name in outer:
                node = node.setdefault(name, {})
            node[last] = z[key]
    return descriptor, parts, expected


def main() -> None:
    """Rewrite golden/affine/*.npz."""
    OUT.mkdir(exist_ok=True)
    for old in OUT.glob("*.npz"):
        old.unlink()
    cases = all_cases()
    for name, note, spec in cases:
        t = parse_type(spec.text())
        assert isinstance(t, QuantType)
        check_descriptor(t)
        meta = json.dumps({"name": name, "note": note, "descriptor": str(t)})
        arrays = {"meta": np.array(meta), **spec.arrays(), "expected": oracle(spec)}
        np.savez_compressed(OUT / f"{name}.npz", allow_pickle=False, **arrays)
    total = sum(p.stat().st_size for p in OUT.glob("*.npz"))
    print(f"wrote {len(cases)} vectors to {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
