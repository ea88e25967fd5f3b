"""GPTQ and AWQ checkpoint layouts, read as they are stored (codes never requantized).

One quantized ``Linear`` of ``N`` outputs and ``K`` inputs, ``b``-bit codes in groups of ``group``
inputs (``G = ceil(K / group)``; ``group`` -1 in the config: one group over ``K``):

- GPTQ (``checkpoint_format`` ``gptq``, v1): ``qweight`` ``i32[K*b/32, N]`` packed along K;
  ``qzeros`` ``i32[G, N*b/32]`` packed along N, storing ``z - 1``; ``scales`` ``f16[G, N]``;
  ``g_idx`` ``i32[K]``, the group of each input;
- GPTQ v2 (``gptq_v2``): the same, ``qzeros`` storing ``z``;
- AWQ ``gemm``: ``qweight`` ``i32[K, N*b/32]`` packed along N, the fields of a word holding output
  channels 0, 2, 4, 6, 1, 3, 5, 7; ``qzeros`` ``i32[G, N*b/32]`` in the same order, storing ``z``;
  ``scales`` ``f16[G, N]``; no ``g_idx``.

``b`` is 2, 3, 4 or 8 (AWQ: 4). Codes are unsigned; fields are LSB first, one bit stream per block
of ``PACKING[b]`` words (for 3 bits, 32 values in 3 words, two of them straddling a word boundary).
``expected`` gives every tensor's dtype and shape for a layer's ``(N, K)``, which ``prequant.py``
checks against the safetensors headers before it reads anything. The published decode is
``W[n, k] = scales[g(k), n] * (q[k, n] - z[g(k), n])`` with ``g = g_idx`` (GPTQ) or ``k // group``.
v1 stores ``z - 1`` and adds the 1 back when it decodes, without wrapping: a stored ``2^b - 1``
(written for ``z = 0``) decodes as ``z = 2^b``, outside the code range.

``translate`` turns a layout into our signed codes (``q - 2^(b-1)``, zero likewise), ``[N, K]`` with
``[N, G]`` qparams; ``reference`` is the published decode computed from the stored tensors by the
formula itself (a gather per input by ``g_idx``), which ``freeze-semantics`` compares bit for bit with
the descriptor's decode. Act order (``desc_act``: a ``g_idx`` that is not ``k // group``) is kept: the
layer carries its ``g_idx``, which ``freeze-semantics`` stores as an explicit column permutation
(``act_order``). That needs every group to hold ``group`` columns (the last one: the rest), as
GPTQ's act order makes them; any other ``g_idx`` is refused naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ gemm: the output channel (within a word's 8) held by nibble ``i`` is ``8w + AWQ_ORDER[i]``."""


class LayoutError(ValueError):
    """A stored tensor that does not fit its format; ``tensor`` is its suffix (``qzeros``)."""

    def __init__(self, tensor: str, field: str, message: str, expected: object = "", found: object = "") -> None:
        self.tensor, self.field, self.message, self.expected, self.found = tensor, field, message, expected, found
        super().__init__(f"{tensor}.{field}: {message}")


@dataclass(frozen=True)
class GptqScheme:
    """What a GPTQ/AWQ config says about every quantized Linear."""

    kind: str
    """``gptq`` (v1), ``gptq_v2`` or ``awq``."""
    bits: int
    group: int
    """Group size along K; -1: one group over K."""
    sym: bool

    def groups(self, k: int) -> int:
        return 1 if self.group == -1 else -(-k // self.group)

    def size(self, k: int) -> int:
        return k if self.group == -1 else self.group

    @property
    def tensors(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales") if self.kind == "awq" else ("qweight", "qzeros", "scales", "g_idx")


PACKING: dict[int, tuple[int, int]] = {
    2: (16, 1),
    3: (32, 3),
    4: (8, 1),
    8: (4, 1),
}
"""Code width -> (values, int32 words) of one packing block. A block's values are one bit stream, LSB
first: value ``j`` holds bits ``[j*b, j*b+b)`` of the block's words read as one little-endian integer.
3-bit (AutoGPTQ ``qlinear_cuda_old.pack``, GPTQModel's ``gptq``/``gptq_v2``: ten values, one that
straddles, ten, one that straddles, ten): value 10 is bits 30-31 of word 0 and bit 0 of word 1,
value 21 bit 31 of word 1 and bits 0-1 of word 2. GPTQModel's planar ``gptq_p`` is another layout."""


def words(count: int, bits: int, tensor: str, what: str) -> int:
    """The int32 words ``count`` ``bits``-bit values fill; a count that is not whole blocks is a
    ``LayoutError`` naming ``tensor`` (the published packers write whole blocks only)."""
    if bits not in PACKING:
        raise LayoutError(tensor, "bits", "unsupported code width", ", ".join(map(str, PACKING)), bits)
    values, span = PACKING[bits]
    if count % values:
        raise LayoutError(
            tensor,
            "shape",
            f"{bits}-bit codes pack {values} values to {span} words",
            f"{what} a multiple of {values}",
            count,
        )
    return count // values * span


def fields(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned ``bits``-bit fields of int32 ``words`` (int16), blocks of ``PACKING[bits]`` laid out
    along ``axis`` (each block of words becomes its values, consecutive there). Field ``j`` of a word
    is its bits ``[j * bits, (j + 1) * bits)``, LSB first; a field of 2, 4 or 8 bits lies within one
    byte of the little-endian word, so those are read from its bytes (``byte_fields``)."""
    values, span = PACKING[bits]
    w32 = np.ascontiguousarray(words)
    u = np.moveaxis(w32.view("<u4") if w32.dtype.itemsize == 4 else w32.astype("<u4"), axis, -1)
    if span == 1 and 8 % bits == 0:
        return np.moveaxis(byte_fields(u, bits), -1, axis)
    blocks = u.reshape(*u.shape[:-1], u.shape[-1] // span, span)
    out = np.empty((*blocks.shape[:-1], values), dtype=np.int16)  # a field holds at most 8 bits
    for j in range(values):
        w, shift = divmod(j * bits, 32)
        v = blocks[..., w] >> shift
        if shift + bits > 32:  # the rest of the field is the low bits of the next word
            v = v | (blocks[..., w + 1] << (32 - shift))
        out[..., j] = v & np.uint32((1 << bits) - 1)
    return np.moveaxis(out.reshape(*u.shape[:-1], -1), -1, axis)


def byte_fields(u: np.ndarray, bits: int) -> np.ndarray:
    """The fields of little-endian uint32 words ``u`` along the last axis, from their bytes: byte ``i``
    of a word holds fields ``i * 8 // bits`` onward, LSB first."""
    b = np.ascontiguousarray(u).view(np.uint8)  # a word's bytes in memory order: least significant first
    per = 8 // bits
    out = np.empty((*b.shape[:-1], b.shape[-1] * per), dtype=np.int16)
    for j in range(per):
        out[..., j::per] = (b >> (j * bits)) & ((1 << bits) - 1)
    return out


def awq_order(values: np.ndarray) -> np.ndarray:
    """Nibble order -> channel order along the last axis (AWQ gemm's interleave undone)."""
    n = values.shape[-1]
    grouped = values.reshape(*values.shape[:-1], n // 8, 8)
    out = np.empty_like(grouped)
    out[..., list(AWQ_ORDER)] = grouped
    return out.reshape(values.shape)


def expect_shape(name: str, arr: np.ndarray, shape: tuple[int, ...], why: str) -> None:
    if tuple(arr.shape) != shape:
        raise LayoutError(name, "shape", f"does not fit the layer ({why})", list(shape), list(arr.shape))


FLOATS = ("F16", "BF16", "F32")
INDEX = ("I32", "I64")


@dataclass(frozen=True)
class Expect:
    """What one stored tensor of a layer must be: its safetensors dtypes and shape, and the layout
    that says so (for messages)."""

    dtypes: tuple[str, ...]
    shape: tuple[int, ...]
    layout: str


def expected(s: GptqScheme, n: int, k: int) -> dict[str, Expect]:
    """Every tensor of one layer of ``N`` outputs and ``K`` inputs as the layout stores it (the
    module docstring), checked against the safetensors headers before anything is read."""
    if s.kind == "awq" and s.bits != 4:
        raise LayoutError("qweight", "bits", "unsupported code width", "4 (AWQ)", s.bits)
    g, b = s.groups(k), s.bits
    zeros = Expect(("I32",), (g, words(n, b, "qzeros", "out")), f"i32[groups, out*{b}/32]")
    scales = Expect(FLOATS, (g, n), "[groups, out]")
    if s.kind == "awq":
        return {
            "qweight": Expect(("I32",), (k, words(n, b, "qweight", "out")), f"i32[in, out*{b}/32]"),
            "qzeros": zeros,
            "scales": scales,
        }
    return {
        "qweight": Expect(("I32",), (words(k, b, "qweight", "in"), n), f"i32[in*{b}/32, out]"),
        "qzeros": zeros,
        "scales": scales,
        "g_idx": Expect(INDEX, (k,), "[in]"),
    }


def unpacked(s: GptqScheme, arrays: dict[str, np.ndarray], n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Unsigned codes ``[K, N]`` and zero points ``[G, N]`` as the decode uses them (v1's + 1 applied)."""
    for name, want in expected(s, n, k).items():
        if name in ("qweight", "qzeros", "scales"):
            expect_shape(name, arrays[name], want.shape, want.layout)
    q = fields(arrays["qweight"], s.bits, 1 if s.kind == "awq" else 0)  # AWQ packs along N, GPTQ along K
    z = fields(arrays["qzeros"], s.bits, 1)
    if s.kind == "awq":
        return awq_order(q), awq_order(z)
    return q, z + 1 if s.kind == "gptq" else z


def group_index(s: GptqScheme, arrays: dict[str, np.ndarray], k: int) -> np.ndarray:
    """``g(k)`` of every input: ``g_idx`` as stored (GPTQ), else ``k // group``."""
    plain = np.arange(k, dtype=np.int64) // s.size(k)
    if s.kind == "awq":
        return plain
    g_idx = np.asarray(arrays["g_idx"])
    expect_shape("g_idx", g_idx, (k,), "[in]")
    if g_idx.size and (int(g_idx.min()) < 0 or int(g_idx.max()) >= s.groups(k)):
        raise LayoutError("g_idx", "value", "names a group the layer does not have", f"0..{s.groups(k) - 1}")
    return g_idx.astype(np.int64)


def act_order(tensor: str, g: np.ndarray, size: int, k: int) -> np.ndarray | None:
    """The group index a layer keeps: ``None`` for the plain order (``g[k] == k // size``); int32 ``g``
    when it is a permutation of that order (act order: each group ``size`` columns, the last the
    rest), which ``freeze-semantics`` stores as a permutation; anything else is a ``LayoutError``
    naming ``tensor`` (``freeze-semantics`` could not express it)."""
    expect_shape(tensor, g, (k,), "[in]")
    plain, groups = np.arange(k, dtype=np.int64) // size, -(-k // size)
    if np.array_equal(g, plain):
        return None
    if g.size and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise LayoutError(tensor, "value", "names a group the layer does not have", f"0..{groups - 1}", int(g.max()))
    counts, want = np.bincount(g, minlength=groups), np.bincount(plain, minlength=groups)
    if not np.array_equal(counts, want):
        j = int(np.argmax(counts != want))
        raise LayoutError(
            tensor,
            "value",
            "act-order group index with uneven groups: freeze-semantics stores act order only as a "
            "permutation of whole groups of group_size columns",
            f"group {j} of {int(want[j])} columns",
            f"{int(counts[j])} columns",
        )
    return np.ascontiguousarray(g, dtype=np.int32)


def reference(s: GptqScheme, arrays: dict[str, np.ndarray], n: int, k: int) -> np.ndarray:
    """The published decode, float32 ``[N, K]``: ``scales[g(k), n] * (q[k, n] - z[g(k), n])``."""
    q, z = unpacked(s, arrays, n, k)
    g = group_index(s, arrays, k)
    scales = np.asarray(arrays["scales"]).astype(np.float32)
    w = scales[g, :] * (q - z[g, :]).astype(np.float32)
    return np.ascontiguousarray(w.T)


def translate(s: GptqScheme, arrays: dict[str, np.ndarray], n: int, k: int) -> dict[str, Any]:
    """Our affine form of one layer: signed ``codes`` int8 ``[N, K]``, ``zero`` int8 ``[N, G]``
    (``None`` when symmetric), ``qmin``/``qmax``, ``group``, ``g_idx`` (int32 ``[K]`` in act order,
    else ``None``; see ``act_order``); the scales are taken as stored."""
    q, z = unpacked(s, arrays, n, k)
    g_idx = act_order("g_idx", group_index(s, arrays, k), s.size(k), k)
    mid = 1 << (s.bits - 1)
    if int(z.max(initial=0)) > 2 * mid - 1 or int(z.min(initial=0)) < 0:
        raise LayoutError(
            "qzeros",
            "value",
            "a zero point outside the code range (GPTQ v1 stores z - 1, so z = 0 reads back as 2^bits)",
            f"0..{2 * mid - 1}",
            int(z.max()),
        )
    zero: np.ndarray | None = np.ascontiguousarray((z - mid).T.astype(np.int8))
    if s.sym:
        if not (z == mid).all():
            raise LayoutError("qzeros", "value", "sym is true but a zero point is not 2^(bits-1)", mid, "other values")
        zero = None
    return {
        "codes": np.ascontiguousarray((q - mid).T.astype(np.int8)),
        "zero": zero,
        "qmin": -mid,
        "qmax": mid - 1,
        "group": s.size(k),
        "g_idx": g_idx,
    }
