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
"""Bit widths a scheme may use (5 only through a backend's block scheme, llama.cpp's ``q5_0``)."""

BUILTIN_GRAMMAR = (
    "w{8,4,2}-channel or w{8,4,2}-g{G} (G a positive integer), optionally followed by -sym (default) or -asym, "
    "then optionally -clip (clipping search); e.g. w8-channel, w8-g32, w4-g32, w4-g128-asym, w2-g16-asym, w4-g32-clip"
)


def grammar() -> str:
    """The accepted spellings: the built-in grammar, then each affine scheme a backend declares
    (``qcompiler.quant.registry``), as quoted by every ``SchemeError``."""
    from qcompiler.quant.registry import affine_names

    more = "".join(f"; or {what}: {', '.join(names)}" for what, names in affine_names().items())
    return BUILTIN_GRAMMAR + more


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
    rounding: str | None = None
    """A scheme a backend declares (``qcompiler.quant.registry``), e.g. ``q4_0``: its provider rounds
    the codes and scales (llama.cpp's reference quantizer: its float32 arithmetic, float16 scales)."""

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise SchemeError(f"invalid scheme field bits={self.bits}: bit width must be 8, 4 or 2")
        if self.group is not None and self.group < 1:
            raise SchemeError(f"invalid scheme field group={self.group}: group size must be a positive integer")

    @property
    def name(self) -> str:
        """The canonical spelling, e.g. ``w8-channel`` or ``w4-g128-asym`` (``-sym`` is omitted)."""
        if self.rounding is not None:
            return self.rounding
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
    return SchemeError(f"invalid quantization scheme {text!r}: {what}; expected {grammar()}")


def parse_scheme(text: str) -> Scheme:
    """Parse ``w8-channel``, ``w4-g32``, ``w4-g128-asym`` ... into a ``Scheme``.

    Raises ``SchemeError`` quoting ``text``, naming the wrong part and listing the grammar.
    """
    if not text:
        raise _error(text, "the scheme is empty")
    from qcompiler.quant.registry import provider

    declared = provider(text)
    provided = None if declared is None else declared.scheme(text)
    if provided is not None:
        return provided
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
