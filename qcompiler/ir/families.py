"""Representation families, registered by declaration.

A family names how codes plus qparams mean a real tensor (its reference decoder arrives with the
frontend). The core only knows the *shape* of each family's descriptor: which qparam slots it
requires or allows, which exception/transform slots, which decoder versions exist, and any extra
rule. A new family is one subclass; nothing in the core changes::

    class Lut(Family, name="lut"):
        required = ("table",)
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from qcompiler.ir.types import DenseType, QuantType, format_shape, shapes_match


class Problem(NamedTuple):
    """A family rule that a descriptor breaks: the field, the message, what was expected and found."""

    field: str
    message: str
    expected: str = ""
    found: str = ""


class Family:
    """Declares one representation family. Subclass with ``class X(Family, name="x")``."""

    name: ClassVar[str] = ""
    registry: ClassVar[dict[str, type[Family]]] = {}
    required: ClassVar[tuple[str, ...]] = ()
    """qparam slots that must be present."""
    optional: ClassVar[tuple[str, ...]] = ()
    """qparam slots that may be present."""
    exceptions: ClassVar[tuple[str, ...]] = ()
    """exception slots (all required when listed)."""
    transforms: ClassVar[tuple[str, ...]] = ()
    """transform slots that may be present."""
    decoders: ClassVar[tuple[int, ...]] = (1,)
    """decoder versions this build knows."""
    nested: ClassVar[bool] = False
    """whether qparam slots may themselves be quantized."""

    def __init_subclass__(cls, name: str = "", **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if not name:
            return
        if name in Family.registry:
            raise TypeError(f"representation family {name!r} registered twice")
        cls.name = name
        Family.registry[name] = cls

    @classmethod
    def check(cls, t: QuantType) -> Problem | None:
        """A family-specific rule; return the problem when ``t`` breaks it."""
        return None

    @classmethod
    def code_bits(cls, t: QuantType) -> int | None:
        """Bits a static descriptor's codes store, when not one code of the code type per element
        (``mixprec``: its 2-bit groups); ``None`` for the default."""
        return None


class Affine(Family, name="affine"):
    """``x = (code - zero) * scale`` per group; ``zero`` absent means symmetric."""

    required = ("scale",)
    optional = ("zero",)
    transforms = ("rotation",)

    @classmethod
    def check(cls, t: QuantType) -> Problem | None:
        rotation = dict(t.transforms).get("rotation")
        if rotation is None:
            return None
        k = t.shape[t.group.axis if t.group is not None else t.rank - 1]
        want = (k, k)
        if not shapes_match(rotation.shape, want):
            return Problem(
                "transforms",
                "rotation must be square over the group axis",
                format_shape(want),
                format_shape(rotation.shape),
            )
        return None


class Ternary(Family, name="ternary"):
    """Codes in {-1, 0, 1} times a per-group scale (BitNet-style, GGUF TQ1_0/TQ2_0)."""

    required = ("scale",)

    @classmethod
    def check(cls, t: QuantType) -> Problem | None:
        a = t.code.alphabet
        values = a.values if a.values is not None else tuple(range(a.lo, a.hi + 1))
        if not set(values) <= {-1, 0, 1}:
            return Problem("code", "ternary codes must lie in {-1,0,1}", "{-1,0,1}", str(a))
        return None


class Float8(Family, name="f8e4m3"):
    """``x = e4m3fn(code) * scale`` per group: each code is the bit pattern of an OCP float8 E4M3
    ("fn": no infinities, NaN at 0x7f/0xff) stored as ``u8`` (compressed-tensors ``float-quantized``).
    The element's value is exact in float32; the multiply is one float32 multiply."""

    required = ("scale",)

    @classmethod
    def check(cls, t: QuantType) -> Problem | None:
        if t.code.dtype.name != "u8":
            return Problem("code", "float8 codes are 8-bit patterns", "u8[0:255]", str(t.code.dtype))
        return None


class Nested(Family, name="nested"):
    """Hierarchical qparams: per-sub-block scales (and mins) that are themselves quantized
    against super-block qparams (GGUF K-quants). ``x = code * scale - min``."""

    required = ("scale",)
    optional = ("min",)
    nested = True


class Mixed(Family, name="mixed"):
    """Low-bit affine codes plus sparse high-precision exceptions (outliers) at listed flat indices."""

    required = ("scale",)
    optional = ("zero",)
    exceptions = ("index", "value")

    @classmethod
    def check(cls, t: QuantType) -> Problem | None:
        slots = dict(t.exceptions)
        index, value = slots.get("index"), slots.get("value")
        if not isinstance(index, DenseType) or not isinstance(value, DenseType):
            return None  # missing or quantized slots are reported by the generic slot rules
        if index.rank != 1 or index.dtype.name not in ("i32", "i64"):
            return Problem(
                "exceptions", "exception index must be a rank-1 i32 or i64 tensor", "i32[n] | i64[n]", index.short()
            )
        if not value.dtype.is_float:
            return Problem("exceptions", "exception values must be a float tensor", "a float dtype", value.dtype.name)
        if value.rank != 1 or not shapes_match(value.shape, index.shape):
            want = format_shape(index.shape)
            return Problem(
                "exceptions",
                "exception values must be rank 1 and as long as the index",
                want,
                format_shape(value.shape),
            )
        return None


QPARAM_USES = ("any", "linear", "matmul", "embedding", "qparam", "activation")
"""Operator requirements a descriptor may state (``req=``)."""

RATE_UNITS = ("weight", "element", "block", "row")
RATE_SCOPES = ("tensor", "block", "group", "artifact")
SELECTION_UNITS = ("element", "vector2", "vector4", "vector8")


from qcompiler.ir import mixprec as _mixprec  # noqa: E402  (registers the family and its layout)

del _mixprec
