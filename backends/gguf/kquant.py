"""The K-quant reference quantizers (ggml's ``quantize_row_q{4,5,6}_K_ref``, no importance matrix),
vectorised over all super-blocks and float32-exact.

ggml searches each sub-block for its scale (and min) by trying a few candidate inverse scales and
keeping the one with the least weighted squared error (Q4_K/Q5_K, ``make_qkx2_quants``) or the
largest ``sumlx^2 / suml2`` (Q6_K, ``make_qx_quants``); then it quantizes the sub-scales to 6 or 8
bits against a float16 super-block scale and re-quantizes every element against the rounded scales.

To reproduce the C bytes (on x86-64, ggml-base is built without ``-march`` or fast-math, so no FMA
contraction: plain float32 arithmetic in source order), every float32 operation happens in ggml's
order. Element arrays are element-major (``(elements per sub-block, sub-blocks)``), so that numpy's
reduction over axis 0 adds row after row like the C loop (numpy sums pairwise only along the
innermost, contiguous axis; the C-oracle tests would catch a numpy that did otherwise).
``nearest_int`` is emulated bit for bit with the ``1.5 * 2^23`` trick wherever its argument is not
bounded; inside the searches it is about ``nmax`` at most and ``np.rint`` (half to even) is the same
function (checked per call, with the emulation as the fallback). Candidates run one after another,
each over all sub-blocks at once; the sequential "keep the best so far" choice is made per sub-block
with ``np.where``, and the winner's levels are recomputed from its inverse scale and min at the end
(the same arithmetic, the same levels).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]
Parts = dict[str, Array]
F32 = np.float32

MAGIC = F32(12582912.0)
"""``1.5 * 2^23``: adding it to a float32 of magnitude below ``2^22`` leaves the rounded integer in
the low 22 mantissa bits."""
RINT_SAFE = F32(2**21)
"""Below this magnitude ``np.rint`` and ``nearest_int`` agree (with room to spare)."""
GROUP_MAX_EPS = F32(1e-15)
"""ggml's threshold below which a (Q6_K) group is all zero."""


def nearest_int(v: Array) -> Array:
    """ggml's ``nearest_int`` on float32 ``v``, bit for bit (also outside its asserted ``|v| <= 2^22 - 1``)."""
    bits = (np.asarray(v, dtype=F32) + MAGIC).view(np.int32)
    return (bits & np.int32(0x7FFFFF)) - np.int32(0x400000)


def seq_sum(a: Array) -> Array:
    """``float s = 0; for (i...) s += a[i];`` over axis 0 of a contiguous ``(n, S)`` float32 array."""
    return np.add.reduce(a, axis=0) + F32(0)  # + 0: a C sum from +0 is never -0


def qkx2_levels(x: Array, base: Array, iscale: Array, nmax: int, bounds: tuple[Array, Array, Array]) -> Array:
    """``MAX(0, MIN(nmax, nearest_int(iscale * (x - base))))`` as float32; ``bounds`` = (min, max, flat)
    of each sub-block (flat ones are answered elsewhere).

    ``np.rint`` (half to even) is ``nearest_int`` while ``|iscale * (x - base)| < 2^22``, which the
    searches keep (it is at most about ``2 * nmax``); if a sub-block could leave that range (a
    degenerate min or span), the whole call takes the bit-exact emulation instead."""
    lo, hi, flat = bounds
    lv = x - base
    lv *= iscale
    reach = np.maximum(np.abs(hi - base), np.abs(lo - base)) * np.abs(iscale)  # >= every |lv|, per sub-block
    if not np.all((reach < RINT_SAFE) | flat):
        return np.clip(nearest_int(lv), 0, nmax).astype(F32)
    np.rint(lv, out=lv)
    return np.clip(lv, F32(0), F32(nmax), out=lv)


def weighted_error(lv: Array, scale: Array, the_min: Array, x: Array, w: Array) -> Array:
    """``sum w * ((scale * l + min) - x)^2`` in ggml's order."""
    diff = lv * scale
    diff += the_min
    diff -= x
    diff *= diff
    diff *= w
    return seq_sum(diff)


def make_qkx2_quants(
    x: Array, w: Array, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[Array, Array, Array]:
    """ggml's ``make_qkx2_quants`` (squared error) on ``(n, S)`` sub-blocks: (scale, -min, levels).

    As in ggml, an accepted candidate's min replaces ``min`` for the candidates after it: their
    ``x - min`` and ``max - min`` use it."""
    lo = x.min(axis=0)
    mn = np.where(lo > 0, F32(0), lo)
    mx = x.max(axis=0)
    flat = mx == mn
    bounds = (lo, mx, flat)
    sum_w, sum_x = seq_sum(w), seq_sum(w * x)
    iscale = F32(nmax) / (mx - mn)
    scale, cur_min, best_iscale, best_base = F32(1) / iscale, mn, iscale, mn
    best = weighted_error(qkx2_levels(x, mn, iscale, nmax, bounds), scale, mn, x, w)
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (mx - cur_min)
        lv = qkx2_levels(x, cur_min, iscale, nmax, bounds)
        wl = w * lv
        t = wl * lv
        sum_l, sum_l2 = seq_sum(wl), seq_sum(t)
        sum_xl = seq_sum(np.multiply(wl, x, out=t))
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clamp = this_min > 0
        this_min = np.where(clamp, F32(0), this_min)
        this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
        err = weighted_error(lv, this_scale, this_min, x, w)
        better = (det > 0) & (err < best)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        best_iscale = np.where(better, iscale, best_iscale)
        best_base = np.where(better, cur_min, best_base)
        cur_min = np.where(better, this_min, cur_min)
    levels = np.where(flat, F32(0), qkx2_levels(x, best_base, best_iscale, nmax, bounds))
    return np.where(flat, F32(0), scale), -np.where(flat, mn, cur_min), levels


def positive_max(a: Array) -> Array:
    """``float m = 0; for (...) if (a[j] > m) m = a[j];`` along axis 1 (``+0`` when nothing is positive)."""
    m = a.max(axis=1)
    return np.where(m > 0, m, F32(0))


def six_bit(values: Array, peak: Array) -> Array:
    """``MIN(63, (uint8_t)nearest_int(inv * v))`` with ``inv = peak > 0 ? 63/peak : 0``."""
    inv = np.where(peak > 0, F32(63) / peak, F32(0))[:, None]
    return np.minimum(nearest_int(inv * values) & np.int32(255), np.int32(63))


def encode_qkx(x: Array, nmax: int, rmin: float, rdelta: float, nstep: int) -> Parts:
    """Q4_K (``nmax`` 15) and Q5_K (31): blocks ``(B, 256)`` -> parts, as ``quantize_row_q{4,5}_K_ref``."""
    blocks = x.shape[0]
    xs = np.ascontiguousarray(x.reshape(blocks * 8, 32).T)  # (32, sub-blocks)
    av_x = np.sqrt(seq_sum(xs * xs) / F32(32))
    w = av_x + np.abs(xs)
    scales, mins, levels = make_qkx2_quants(xs, w, nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(blocks, 8), mins.reshape(blocks, 8)
    max_scale, max_min = positive_max(scales), positive_max(mins)
    sc, mn = six_bit(scales, max_scale), six_bit(mins, max_min)
    d16, dmin16 = (max_scale / F32(63)).astype(np.float16), (max_min / F32(63)).astype(np.float16)
    d = (d16.astype(F32)[:, None] * sc.astype(F32)).reshape(-1)
    dm = (dmin16.astype(F32)[:, None] * mn.astype(F32)).reshape(-1)
    requant = np.clip(nearest_int((xs + dm) / d), 0, nmax)
    codes = np.where(d != 0, requant, levels.astype(np.int32)).T.reshape(blocks, 256).astype(np.uint8)
    return {
        "codes": codes,
        "sub_scale": sc.astype(np.uint8),
        "sub_min": mn.astype(np.uint8),
        "d": d16[:, None],
        "dmin": dmin16[:, None],
    }


def qx_levels(x: Array, iscale: Array) -> Array:
    """``MAX(-32, MIN(31, nearest_int(iscale * x)))`` as float32: ``|iscale * x| <= 32.9`` (``iscale``
    is ``-(32 + 0.1 k) / max``), so ``np.rint`` is ``nearest_int``; all-zero sub-blocks are discarded."""
    lv = x * iscale
    np.rint(lv, out=lv)
    return np.clip(lv, F32(-32), F32(31), out=lv)


def make_qx_quants(x: Array) -> tuple[Array, Array]:
    """ggml's ``make_qx_quants(16, 32, rmse_type=1)`` on ``(16, S)`` sub-blocks: (scale, levels 0..63)."""
    cols = np.arange(x.shape[1])
    peak = np.abs(x).argmax(axis=0)  # the first of the largest |x|
    signed_max = x[peak, cols]
    zero = np.abs(signed_max) < GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def sums(lv: Array) -> tuple[Array, Array]:
        t = wx * lv
        sumlx = seq_sum(t)
        np.multiply(w, lv, out=t)
        t *= lv
        return sumlx, seq_sum(t)

    best_iscale = F32(-32) / signed_max
    sumlx, suml2 = sums(qx_levels(x, best_iscale))
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        iscale = -(F32(32) + F32(0.1) * F32(step)) / signed_max
        sumlx, suml2 = sums(qx_levels(x, iscale))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
        best_iscale = np.where(better, iscale, best_iscale)
    levels = np.where(zero, F32(0), qx_levels(x, best_iscale) + F32(32))
    return np.where(zero, F32(0), scale), levels


def encode_q6_k(x: Array) -> Parts:
    """Q6_K: blocks ``(B, 256)`` -> parts, as ``quantize_row_q6_K_ref``."""
    blocks = x.shape[0]
    xs = np.ascontiguousarray(x.reshape(blocks * 16, 16).T)  # (16, sub-blocks)
    scale, levels = make_qx_quants(xs)
    scales = scale.reshape(blocks, 16)
    peak = np.abs(scales).argmax(axis=1)  # the first of the largest |scale|
    max_scale = scales[np.arange(blocks), peak]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = (F32(-128) / max_scale)[:, None]
    d16 = np.where(zero, F32(0), F32(1) / iscale[:, 0]).astype(np.float16)
    sc = np.where(zero[:, None], 0, np.minimum(nearest_int(iscale * scales), np.int32(127))).astype(np.int8)
    d = (d16.astype(F32)[:, None] * sc.astype(F32)).reshape(-1)
    requant = np.clip(nearest_int(xs / d), -32, 31) + 32
    q = np.where(d != 0, requant, levels.astype(np.int32)).T.reshape(blocks, 256)
    codes = np.where(zero[:, None], 0, q).astype(np.int16) - 32
    return {"codes": codes.astype(np.int8), "sub_scale": sc, "d": d16[:, None]}
