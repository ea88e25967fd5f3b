"""Group fitting and encoding of the mixed 2/4/16-bit representation (``qcompiler.quant.mixprec``).

Every group's zero point and scale code are searched against the DECODED scale (the float32 value
``scale_codes * scale2`` the decoder will use): per group, shrink ratios of its range times a zero
point shift of -1, 0 or +1, least (Hessian-diagonal weighted) squared error over its non-outlier
elements. ``zero2`` is always 0: first-level scales are positive, and ``scale2`` (float16, rounded
up) is the block's largest scale over 255. Everything here is float64 numpy, with no randomness.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from qcompiler.quant.mixprec import MixedQuant, index_dtype

F64 = NDArray[np.float64]
Mask = NDArray[np.bool_]

RATIOS = tuple(1.0 - 0.05 * i for i in range(13))
"""Fractions of a group's range tried: 1.0 down to 0.4."""

SHIFTS = (-1, 0, 1)
"""Zero-point shifts tried around the rounded zero of each ratio."""

DAMP = 0.3
"""GPTQ damping, a fraction of the Hessian's mean diagonal added to it: large, because a calibration
set of a few hundred tokens leaves ``X^T X`` of a wide layer rank-deficient (0.01, GPTQ's usual,
overfits it on all-MiniLM-L6-v2)."""

TINY_SCALE2 = np.float16(2.0**-24)
"""The smallest ``scale2`` (float16's least subnormal): an all-zero block still decodes to 0."""


class Fit(NamedTuple):
    """Qparams of a set of groups ``[N, ng]``; ``s1`` the decoded scales (float32 values in float64)."""

    scale_codes: NDArray[np.uint8]
    scale2: NDArray[np.float16]
    zero: NDArray[np.uint8]
    s1: F64
    err: F64


def second_level(s_full: F64, group2: int) -> NDArray[np.float16]:
    """``scale2 [ceil(N / G2), ng]``: each block's largest scale over 255, rounded up in float16."""
    n, ng = s_full.shape
    nb = -(-n // group2)
    padded = np.pad(s_full, ((0, nb * group2 - n), (0, 0)))
    peak = padded.reshape(nb, group2, ng).max(axis=1) / 255.0
    s2 = peak.astype(np.float16)
    s2 = np.where(s2.astype(np.float64) < peak, np.nextafter(s2, np.float16(np.inf)), s2)
    return np.maximum(s2, TINY_SCALE2).astype(np.float16)


def _sq_err(x: F64, keep: Mask, hw: F64 | None, s1: F64, z: F64, qmax: F64) -> F64:
    """Weighted squared error of each group ``[N, ng]`` rounded with scale ``s1`` and zero ``z``."""
    codes = np.clip(np.rint(x / s1[..., None]) + z[..., None], 0.0, qmax[..., None])
    d = x - (codes - z[..., None]) * s1[..., None]
    d *= d
    if hw is not None:
        d *= hw
    return np.where(keep, d, 0.0).sum(axis=-1)


def fit_groups(x: F64, keep: Mask, qmax: F64, hw: F64 | None, group2: int) -> Fit:
    """Fit ``x [N, ng, G]`` (``keep``: the non-outlier elements; ``qmax [N, ng]``: 3 or 15 per group;
    ``hw [ng, G]``: column weights, or ``None``) with the least-error ratio and zero shift."""
    lo = np.minimum(np.where(keep, x, np.inf).min(axis=-1), 0.0)
    hi = np.maximum(np.where(keep, x, -np.inf).max(axis=-1), 0.0)
    s_full = (hi - lo) / qmax
    s2 = second_level(s_full, group2)
    s2r = s2.astype(np.float32)[np.arange(x.shape[0]) // group2]
    best = np.full(s_full.shape, np.inf)
    best_q = np.ones(s_full.shape)
    best_z = np.zeros(s_full.shape)
    for ratio in RATIOS:
        q = np.clip(np.rint(s_full * ratio / s2r), 1.0, 255.0)
        s1 = (q.astype(np.float32) * s2r).astype(np.float64)
        z0 = np.rint(-lo * ratio / s1)
        for shift in SHIFTS:
            z = np.clip(z0 + shift, 0.0, qmax)
            err = _sq_err(x, keep, hw, s1, z, qmax)
            better = err < best
            best = np.where(better, err, best)
            best_q = np.where(better, q, best_q)
            best_z = np.where(better, z, best_z)
    s1 = (best_q.astype(np.float32) * s2r).astype(np.float64)
    return Fit(best_q.astype(np.uint8), s2, best_z.astype(np.uint8), s1, best)


def round_codes(x: F64, fit: Fit, qmax: F64) -> NDArray[np.uint8]:
    """Codes of ``x [N, ng, G]`` under ``fit``."""
    z = fit.zero.astype(np.float64)[..., None]
    return np.clip(np.rint(x / fit.s1[..., None]) + z, 0.0, qmax[..., None]).astype(np.uint8)


def group_errors(x: F64, hw: F64 | None, group: int, group2: int) -> tuple[F64, F64]:
    """Per group ``[N, ng]``: the (weighted) squared error at 2 bits and at 4 bits, no outliers."""
    n, k = x.shape
    xg = x.reshape(n, k // group, group)
    keep = np.ones(xg.shape, dtype=np.bool_)
    hwg = None if hw is None else hw.reshape(k // group, group)
    ones = np.ones((n, k // group))
    err2 = fit_groups(xg, keep, 3.0 * ones, hwg, group2).err
    err4 = fit_groups(xg, keep, 15.0 * ones, hwg, group2).err
    return err2, err4


def pick_outliers(x: F64, is4: Mask, hw: F64 | None, group: int, nnz: int) -> Mask:
    """``nnz`` outliers in 2-bit groups: the largest within-group z-scores (times the column's weight
    over the group's mean weight), at most ``G // 8`` a group. A mask ``[N, K]``."""
    n, k = x.shape
    ng = k // group
    xg = x.reshape(n, ng, group)
    dev = xg - xg.mean(axis=-1, keepdims=True)
    score = dev * dev / np.maximum((dev * dev).mean(axis=-1, keepdims=True), 1e-300)
    if hw is not None:
        hwg = hw.reshape(ng, group)
        score = score * hwg / np.maximum(hwg.mean(axis=-1, keepdims=True), 1e-300)
    rank = np.argsort(np.argsort(-score, axis=-1, kind="stable"), axis=-1, kind="stable")
    score = np.where(is4[..., None] | (rank >= group // 8), -np.inf, score).reshape(-1)
    order = np.argsort(-score, kind="stable")[: min(nnz, int(np.isfinite(score).sum()))]
    mask = np.zeros(n * k, dtype=np.bool_)
    mask[order] = True
    return mask.reshape(n, k)


def encode_rtn(x: F64, is4: Mask, out: Mask, hw: F64 | None, group: int, group2: int) -> MixedQuant:
    """Round-to-nearest encoding of ``x [N, K]`` with the 4-bit groups ``is4 [N, ng]`` and outliers ``out``."""
    n, k = x.shape
    xg = x.reshape(n, k // group, group)
    keep = ~out.reshape(xg.shape)
    qmax = np.where(is4, 15.0, 3.0)
    hwg = None if hw is None else hw.reshape(k // group, group)
    fit = fit_groups(xg, keep, qmax, hwg, group2)
    codes = np.where(keep, round_codes(xg, fit, qmax), fit.zero[..., None]).reshape(n, k)
    return assemble(codes, fit, is4, out, x[out], group, group2)


def assemble(
    codes: NDArray[np.uint8], fit: Fit, is4: Mask, out: Mask, values: F64, group: int, group2: int
) -> MixedQuant:
    """The ``MixedQuant`` of codes, qparams, the 4-bit mask and the outliers (``values`` row-major)."""
    n, k = codes.shape
    whole: Mask = np.all(is4, axis=1)  # the canonical map: a row of 4-bit groups is listed as a row
    rows, cols = np.nonzero(out)
    rowptr = np.zeros(n + 1, dtype=np.int64)
    rowptr[1:] = np.cumsum(np.bincount(rows, minlength=n))
    rowptr = rowptr.astype(np.int16 if rows.shape[0] <= 32767 else np.int32)  # values 0..nnz
    return MixedQuant(
        codes=np.ascontiguousarray(codes, dtype=np.uint8),
        zero=fit.zero,
        scale_codes=fit.scale_codes,
        scale2=fit.scale2,
        zero2=np.zeros(fit.scale2.shape, dtype=np.uint8),
        wide=np.flatnonzero(is4 & ~whole[:, None]).astype(index_dtype(is4.size)),
        wide_rows=np.flatnonzero(whole).astype(index_dtype(n)),
        rowptr=rowptr,
        col=cols.astype(index_dtype(k)),
        value=values.astype(np.float16),
        group=group,
        group2=group2,
    )


def encode_gptq(x: F64, hessian: F64, is4: Mask, out: Mask, group: int, group2: int, damp: float = DAMP) -> MixedQuant:
    """GPTQ-style encoding: columns in order, each quantization error fed back into the columns not yet
    quantized through the inverse Hessian's Cholesky factor. A group's qparams (every row) are fitted
    on the updated weights when its first column comes; outliers keep their updated value exactly."""
    return encode_gptq_loss(x, hessian, is4, out, group, group2, damp)[0]


def encode_gptq_loss(
    x: F64, hessian: F64, is4: Mask, out: Mask, group: int, group2: int, damp: float = DAMP
) -> tuple[MixedQuant, F64]:
    """``encode_gptq`` and its loss per group ``[N, ng]``: the sum over the group's columns of the squared
    scaled errors ``((w - q) / U[j, j]) ** 2``, whose total is the (damped) proxy loss
    ``(W - Q) H (W - Q)^T`` summed over rows."""
    n, k = x.shape
    ng = k // group
    h = hessian.copy()
    diag = np.diagonal(h).copy()
    h[np.arange(k), np.arange(k)] += damp * max(float(diag.mean()), 1e-12) + (diag == 0)
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: inverse = u.T @ u
    w = x.copy()
    qmax = np.where(is4, 15.0, 3.0)
    codes = np.zeros((n, k), dtype=np.uint8)
    fits: list[Fit] = []
    values = np.zeros((n, k))
    loss = np.zeros((n, ng))
    for g in range(ng):
        c0, c1 = g * group, (g + 1) * group
        fit = fit_groups(w[:, None, c0:c1], ~out[:, None, c0:c1], qmax[:, g : g + 1], diag[None, c0:c1], group2)
        fits.append(fit)
        s1, z, top = fit.s1[:, 0], fit.zero[:, 0].astype(np.float64), qmax[:, g]
        err = np.zeros((n, group))
        for j in range(c0, c1):
            col = w[:, j]
            c = np.clip(np.rint(col / s1) + z, 0.0, top)
            c = np.where(out[:, j], z, c)
            q = np.where(out[:, j], col.astype(np.float16).astype(np.float64), (c - z) * s1)
            codes[:, j], values[:, j] = c.astype(np.uint8), col
            e = (col - q) / u[j, j]
            err[:, j - c0] = e
            w[:, j + 1 : c1] -= np.outer(e, u[j, j + 1 : c1])
        loss[:, g] = (err * err).sum(axis=1)
        w[:, c1:] -= err @ u[c0:c1, c1:]
    joined = Fit(
        np.concatenate([f.scale_codes for f in fits], axis=1),
        np.concatenate([f.scale2 for f in fits], axis=1),
        np.concatenate([f.zero for f in fits], axis=1),
        np.concatenate([f.s1 for f in fits], axis=1),
        np.concatenate([f.err for f in fits], axis=1),
    )
    return assemble(codes, joined, is4, out, values[out], group, group2), loss
