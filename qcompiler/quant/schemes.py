"""Weight quantization schemes: bit width, grouping and symmetry, spelled as one short string.

Grammar (one ``-`` between parts, lower case, no spaces)::

    scheme := 'w' BITS '-' grouping ('-sym' | '-asym')? ('-clip')?     BITS in {8, 4, 2}
    grouping := 'channel'                                     one group spans all of K
              | 'g' G                                         groups of G along K, G >= 1

Examples: ``w8-channel``, ``w8-g32``, ``w4-g32``, ``w4-g128-asym``, ``w2-g16-asym``. Symmetric is
the default, so ``w4-g32-sym`` parses to the same scheme as ``w4-g32`` and its canonical ``name``
omits the suffix.

Codes are always *signed* integers in ``[-2^(b-1), 2^(b-1) - 1]``, for both symmetric and
asymmetric schemes. An asymmetric scheme stores its zero point in the same signed range (``i8``
container), so a 4-bit asymmetric weight decodes as ``(code - zero) * scale`` with ``code`` and
``zero`` both in ``[-8, 7]``. (torchao and GPTQ often use unsigned codes ``[0, 2^b - 1]`` for
asymmetric schemes; that is the same grid shifted by ``2^(b-1)`` in both code and zero point.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qcompiler.errors import QcError

SUPPORTED_BITS = (8, 4, 2, 5)
"""Bit widths a scheme may use (5 only through the ggml ``q5_0`` scheme)."""

GGML_SCHEMES = {"q8_0": 8, "q4_0": 4, "q5_0": 5}
"""llama.cpp's symmetric 32-element block types, quantized with its reference rounding (f16 scales)."""

GRAMMAR = (
    "w{8,4,2}-channel or w{8,4,2}-g{G} (G a positive integer), optionally followed by -sym (default) or -asym, "
    "then optionally -clip (clipping search); e.g. w8-channel, w8-g32, w4-g32, w4-g128-asym, w2-g16-asym, w4-g32-clip; "
    "or a ggml block type quantized as llama.cpp does: q8_0, q4_0, q5_0"
)
"""The accepted spellings, quoted by every ``SchemeError``."""

_BITS_RE = re.compile(r"w([0-9]+)")
_GROUP_RE = re.compile(r"g([0-9]+)")


class SchemeError(QcError):
    """A quantization scheme string (or ``Scheme`` field) is malformed.

    The message quotes the input, names the part that is wrong and lists the accepted grammar.
    """


@dataclass(frozen=True)
class Scheme:
    """A weight quantization scheme: ``bits`` per code, ``group`` size along K, ``symmetric``.

    ``group`` is ``None`` for per-channel quantization (one group spans the whole K axis of a row).
    ``Scheme(4, 128, False).name == "w4-g128-asym"``.
    """

    bits: int
    group: int | None
    symmetric: bool = True
    clip: bool = False
    """Search per group for the clipped range (100% down to 50%) with the least squared error."""
    ggml: str | None = None
    """Quantize exactly as llama.cpp's reference quantizer for this ggml type (``q8_0``, ``q4_0``,
    ``q5_0``): its rounding, its float32 arithmetic and float16 scales, byte-identical blocks."""

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise SchemeError(f"invalid scheme field bits={self.bits}: bit width must be 8, 4 or 2")
        if self.group is not None and self.group < 1:
            raise SchemeError(f"invalid scheme field group={self.group}: group size must be a positive integer")

    @property
    def name(self) -> str:
        """The canonical spelling, e.g. ``w8-channel`` or ``w4-g128-asym`` (``-sym`` is omitted)."""
        if self.ggml is not None:
            return self.ggml
        grouping = "channel" if self.group is None else f"g{self.group}"
        suffix = ("" if self.symmetric else "-asym") + ("-clip" if self.clip else "")
        return f"w{self.bits}-{grouping}{suffix}"

    @property
    def qmin(self) -> int:
        """Smallest code: ``-2^(bits-1)`` (codes are signed for symmetric and asymmetric schemes)."""
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        """Largest code: ``2^(bits-1) - 1``."""
        return (1 << (self.bits - 1)) - 1

    def __str__(self) -> str:
        return self.name


def _error(text: str, what: str) -> SchemeError:
    return SchemeError(f"invalid quantization scheme {text!r}: {what}; expected {GRAMMAR}")


def parse_scheme(text: str) -> Scheme:
    """Parse ``w8-channel``, ``w4-g32``, ``w4-g128-asym`` ... into a ``Scheme``.

    Raises ``SchemeError`` quoting ``text``, naming the wrong part and listing the grammar.
    """
    if not text:
        raise _error(text, "the scheme is empty")
    if text in GGML_SCHEMES:
        return Scheme(GGML_SCHEMES[text], 32, True, False, text)
    parts = text.split("-")
    bits_match = _BITS_RE.fullmatch(parts[0])
    if bits_match is None:
        raise _error(text, f"bit width part must be w8, w4 or w2 (found {parts[0]!r})")
    bits = int(bits_match.group(1))
    if bits not in (8, 4, 2):
        raise _error(text, f"bit width must be 8, 4 or 2 (found {bits})")
    if len(parts) < 2:
        raise _error(text, "missing grouping part (channel or g{G})")
    group = _parse_group(text, parts[1])
    rest = parts[2:]
    clip = bool(rest) and rest[-1] == "clip"
    if clip:
        rest = rest[:-1]
    symmetric = True
    if rest:
        if rest[0] not in ("sym", "asym"):
            raise _error(text, f"symmetry suffix must be sym or asym (found {rest[0]!r})")
        symmetric = rest[0] == "sym"
    if len(rest) > 1:
        raise _error(text, f"unexpected trailing part {'-'.join(rest[1:])!r}")
    return Scheme(bits, group, symmetric, clip)


def _parse_group(text: str, part: str) -> int | None:
    if part == "channel":
        return None
    match = _GROUP_RE.fullmatch(part)
    if match is None:
        raise _error(text, f"grouping part must be channel or g{{G}} (found {part!r})")
    size = int(match.group(1))
    if size < 1:
        raise _error(text, f"group size must be a positive integer (found {size})")
    return size
