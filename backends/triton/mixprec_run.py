"""Running the mixed 2/4-bit kernels of ``mixprec_codegen`` from a weight's logical arrays.

``MixWeight`` holds the logical arrays (numpy): ``codes`` u8 ``[N, K]``, ``wide`` (sorted flat group
indices ``r * (K / G) + g`` of the 4-bit groups), ``zero`` u8 ``[N, K / G]``, the nested scale
(``scale_codes`` u8 ``[N, K / G]``, ``scale2`` f16 and ``zero2`` u8 ``[ceil(N / G2), K / G]``) and the
outliers as CSR (``rowptr``, ``col``, ``value`` f16). ``pack_planes`` gives the container form (low and
high planes), ``prepare`` the kernel inputs on a torch device (the planes as stored, the per-group arrays
transposed, the reordered high plane with ``hbase``/``hrank``, and ``tn``: see the codegen's docstring),
``run_mixprec`` one phase. CPU tensors run under Triton's interpreter (``interpret=True``); bf16 runs on a
CUDA device only. ``compile_mixprec`` builds every kernel for sm_80 and sm_90 without a GPU.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qcompiler.backends.triton.aot import DECODE_SPLITS, TARGETS
from qcompiler.backends.triton.jit import load_source
from qcompiler.backends.triton.mixprec_codegen import MixKey, generate_mixprec, launch, params
from qcompiler.backends.triton.runtime import INT32_LIMIT, options, split_k
from qcompiler.ir.mixprec import pack2, unpack2

TORCH = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


@dataclass(frozen=True)
class MixWeight:
    codes: np.ndarray
    wide: np.ndarray
    zero: np.ndarray
    scale_codes: np.ndarray
    scale2: np.ndarray
    zero2: np.ndarray
    rowptr: np.ndarray
    col: np.ndarray
    value: np.ndarray
    group: int
    group2: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def first_scale(self) -> np.ndarray:
        return first_scale(self.scale_codes, self.scale2, self.zero2, self.group2)

    def decode(self) -> np.ndarray:
        """The reference decode ``W`` f32 ``[N, K]``: affine part, then the outliers replace their elements."""
        n = self.shape[0]
        rep = np.repeat
        centred = (self.codes.astype(np.int32) - rep(self.zero.astype(np.int32), self.group, axis=1)).astype(np.float32)
        w = np.multiply(centred, rep(self.first_scale(), self.group, axis=1), dtype=np.float32)
        rows = np.repeat(np.arange(n), np.diff(self.rowptr))
        w[rows, self.col.astype(np.int64)] = self.value.astype(np.float32)
        return w

    def validate(self) -> None:
        """Shapes, code ranges, and the replacement contract (outliers only where a 2-bit code is the zero)."""
        n, k = self.shape
        g = self.group
        if k % g or g % 16:
            raise ValueError(f"K {k} must be a multiple of the group {g}, itself a multiple of 16")
        groups = n * (k // g)
        wide = np.zeros(groups, dtype=bool)
        wide[self.wide.astype(np.int64)] = True
        if len(self.wide) and (np.any(np.diff(self.wide) <= 0) or self.wide[0] < 0 or self.wide[-1] >= groups):
            raise ValueError("wide: group indices must be sorted, unique and in range")
        limit = np.where(wide.reshape(n, k // g), 15, 3)
        if np.any(self.codes.reshape(n, k // g, g).max(axis=2) > limit):
            raise ValueError("a code exceeds its group's width (3 in 2-bit groups, 15 in 4-bit groups)")
        if self.rowptr.shape != (n + 1,) or self.rowptr[0] != 0 or np.any(np.diff(self.rowptr) < 0):
            raise ValueError("rowptr must be non-decreasing from 0, one entry per row plus one")
        rows = np.repeat(np.arange(n), np.diff(self.rowptr))
        cols = self.col.astype(np.int64)
        if len(cols) != self.rowptr[-1] or len(self.value) != len(cols) or np.any((cols < 0) | (cols >= k)):
            raise ValueError("col/value must hold rowptr[-1] entries, columns in [0, K)")
        if np.any(wide.reshape(n, k // g)[rows, cols // g]):
            raise ValueError("an outlier sits in a 4-bit group (outliers are only in 2-bit groups)")
        if np.any(self.codes[rows, cols] != self.zero[rows, cols // g]):
            raise ValueError("an outlier's code is not its group's zero (replacement needs a zero base)")


def first_scale(scale_codes: np.ndarray, scale2: np.ndarray, zero2: np.ndarray, group2: int) -> np.ndarray:
    """``s1`` f32 ``[N, K / G]`` from the second level, in the stated rounding order."""
    rows = np.arange(scale_codes.shape[0]) // group2
    diff = np.subtract(scale_codes.astype(np.float32), zero2[rows].astype(np.float32), dtype=np.float32)
    return np.multiply(diff, scale2[rows].astype(np.float32), dtype=np.float32)


def pack_planes(codes: np.ndarray, wide: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Container form: low plane u8 ``[N, K / 4]`` (bits 0-1 of every code), high plane u8 ``[n4, G / 4]``
    (bits 2-3 of the 4-bit groups' codes in ``wide`` order); 4 codes per byte, LSB first (the IR's
    ``planes-a16`` planes without their padding)."""
    n, k = codes.shape
    c = codes.astype(np.uint8)
    hi = c.reshape(n * (k // group), group)[wide.astype(np.int64)] >> 2
    return pack2(c & 3).reshape(n, k // 4), pack2(hi).reshape(-1, group // 4)


def unpack_planes(lo: np.ndarray, hi: np.ndarray, wide: np.ndarray, n: int, k: int, group: int) -> np.ndarray:
    """The codes u8 ``[N, K]`` back from the planes (the inverse of ``pack_planes``)."""
    codes = unpack2(lo.reshape(-1)).reshape(n, k)
    codes.reshape(n * (k // group), group)[wide.astype(np.int64)] |= unpack2(hi.reshape(-1)).reshape(-1, group) << 2
    return codes


def high_plane_repack(
    hi: np.ndarray, wide: np.ndarray, n: int, groups: int, block_n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The high plane reordered column-major, ``hbase`` i32 ``[groups, ceil(N / block_n)]`` and ``hrank``
    u8 ``[groups, N]`` (255: a 2-bit group), so that a 4-bit group's row is ``hbase[g, r // block_n] +
    hrank[g, r]`` (see the codegen's docstring)."""
    if block_n > 255:
        raise ValueError(f"BLOCK_N {block_n}: a rank within a tile must fit a byte below 255")
    is_wide = np.zeros(n * groups, dtype=bool)
    is_wide[wide.astype(np.int64)] = True
    col_major = is_wide.reshape(n, groups).T  # [groups, N]
    before = (np.cumsum(col_major.reshape(-1)) - col_major.reshape(-1)).reshape(groups, n)  # exclusive
    tiles = -(-n // block_n)
    hbase = before[:, np.arange(tiles) * block_n].astype(np.int32)
    rank = before - np.repeat(hbase, block_n, axis=1)[:, :n]
    hrank = np.where(col_major, rank, 255).astype(np.uint8)
    order = np.lexsort((wide // groups, wide % groups))  # by column, then row
    return hi[order], hbase, hrank


def kernel_module(key: MixKey, interpret: bool) -> ModuleType:
    """The generated module for ``key`` (cached per process), as ``jit.kernel_module`` does for ``KernelKey``."""
    return load_source(key.id, generate_mixprec(key), interpret)


def prepare(key: MixKey, w: MixWeight, device: torch.device, interpret: bool, sms: int = 8) -> dict[str, Any]:
    """The kernel inputs from the logical arrays: planes, per-group arrays, ``hbase``/``hrank``, CSR, ``tn``."""
    w.validate()
    n, k = w.shape
    if (w.group, w.group2) != (key.group, key.group2):
        raise ValueError(f"{key.id}: the weight has group {w.group} / {w.group2}")
    if interpret and "bf16" in (key.act, key.out):
        raise ValueError(f"{key.id}: Triton's CPU interpreter computes bf16 on raw bits; bf16 runs on CUDA only")
    if not key.outliers and len(w.col):
        raise ValueError(f"{key.id}: the key drops the outlier correction and the weight has {len(w.col)} outliers")
    lo, hi = pack_planes(w.codes, w.wide, w.group)
    bn = launch(key)["decode"]["BLOCK_N"]
    hi, hbase, hrank = high_plane_repack(hi, w.wide, n, k // w.group, bn)
    counts = np.diff(w.rowptr).astype(np.int32)
    tiles = -(-n // bn)
    tn = np.zeros(tiles * bn, dtype=np.int32)
    tn[:n] = counts
    hi_rows = hi if len(hi) else np.zeros((1, w.group // 4), dtype=np.uint8)  # a valid pointer, never read

    def put(a: np.ndarray, dtype: Any = None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return (t if dtype is None else t.to(dtype)).contiguous().to(device)

    h: dict[str, Any] = {
        "lo": put(lo),
        "hi": put(hi_rows),
        "hbase": put(hbase),
        "hrank": put(hrank),
        "z": put(w.zero.astype(np.uint8).T),
        "sc": put(w.scale_codes.astype(np.uint8).T),
        "s2": put(w.scale2.astype(np.float16).T),
        "z2": put(w.zero2.astype(np.uint8).T),
        "n": n,
        "k": k,
        "sms": sms,
        "module": kernel_module(key, interpret),
    }
    if key.outliers:
        h["rp"] = put(w.rowptr.astype(np.int32))
        h["col"] = put(w.col.astype(np.int32) if len(w.col) else np.zeros(1, np.int32))
        h["val"] = put(w.value.astype(np.float16) if len(w.value) else np.zeros(1, np.float16))
        h["tn"] = put(tn.reshape(tiles, bn).max(axis=1).astype(np.int32))
    return h


def weight_args(key: MixKey, h: dict[str, Any]) -> list[Any]:
    names = ["lo", "hi", "hbase", "hrank", "z", "sc", "s2", "z2", *(["rp", "col", "val", "tn"] if key.outliers else [])]
    return [h[name] for name in names]


def run_mixprec(
    key: MixKey, phase: str, h: dict[str, Any], x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` with the ``decode`` (split-K + reduce) or ``prefill`` kernel."""
    mod: ModuleType = h["module"]
    n, k = h["n"], h["k"]
    lead = list(x.shape[:-1])
    x2 = x.reshape(-1, k).to(TORCH[key.act]).contiguous()
    m = x2.shape[0]
    if max(m * k, m * n, n * k) >= INT32_LIMIT:
        raise ValueError(f"{key.id}: [{m}, {k}] x [{n}, {k}] exceeds the kernels' int32 offsets")
    if key.bias != (bias is not None):
        raise ValueError(
            f"{key.id}: the kernel {'fuses a bias' if key.bias else 'has no bias'}; given: {bias is not None}"
        )
    b = [] if bias is None else [bias.to(TORCH[key.out]).contiguous()]
    y = torch.empty(m, n, dtype=TORCH[key.out], device=x2.device)
    if m == 0:
        return y.reshape([*lead, n])
    cfgs = launch(key)
    if phase == "prefill":
        consts, opts = options(cfgs["prefill"])
        grid = (-(-m // consts["BLOCK_M"]) * -(-n // consts["BLOCK_N"]),)
        mod.prefill[grid](x2, *weight_args(key, h), *b, y, m, n, k, **consts, **opts)
        return y.reshape([*lead, n])
    consts, opts = options(cfgs["decode"])
    split = split_k(m, n, k, h["sms"], cfgs["decode"])
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else y
    grid = (-(-m // consts["BLOCK_M"]) * -(-n // consts["BLOCK_N"]), split)
    mod.decode[grid](x2, *weight_args(key, h), *b, y, ws, m, n, k, **consts, SPLIT_K=split, **opts)
    if split > 1:
        rc, ropts = options(cfgs["reduce"])
        mod.reduce[(-(-m * n // rc["BLOCK"]),)](ws, *b, y, m, n, split, **rc, **ropts)
    return y.reshape([*lead, n])


def random_weight(
    n: int, k: int, group: int, group2: int, wide_frac: float = 0.25, outlier_frac: float = 0.005, seed: int = 0
) -> tuple[MixWeight, np.ndarray]:
    """A float weight and its mixed-precision quantization: the widest-ranging groups 4-bit, the largest
    elements of the 2-bit groups kept as fp16 outliers, the scales second-level quantized (u8 codes)."""
    rng = np.random.default_rng(seed)
    wf = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    gs = wf.reshape(n, k // group, group)
    spread = (gs.max(axis=2) - gs.min(axis=2)).reshape(-1)
    wide = np.sort(np.argsort(-spread, kind="stable")[: int(len(spread) * wide_frac)])
    is_wide = np.zeros(len(spread), dtype=bool)
    is_wide[wide] = True
    is_wide = is_wide.reshape(n, k // group)
    # outliers: the largest |w| of each 2-bit group's row slice, taken out of the range the codes cover
    flat = np.abs(wf) * np.repeat(~is_wide, group, axis=1)
    picks = np.argsort(-flat.reshape(-1), kind="stable")[: int(n * k * outlier_frac)]
    mask = np.zeros(n * k, dtype=bool)
    mask[picks] = True
    mask = mask.reshape(n, k)
    inner = np.where(mask, 0.0, wf).reshape(n, k // group, group)
    lo_v, hi_v = np.minimum(inner.min(axis=2), 0), np.maximum(inner.max(axis=2), 0)
    qmax = np.where(is_wide, 15, 3)
    s1 = np.maximum((hi_v - lo_v) / qmax, 1e-8).astype(np.float32)
    rows2 = -(-n // group2)
    padded = np.zeros((rows2 * group2, k // group), dtype=np.float32)
    padded[:n] = s1
    s2 = (padded.reshape(rows2, group2, -1).max(axis=1) / 255).astype(np.float16)
    s2 = np.maximum(s2, np.float16(1e-7))
    zero2 = np.zeros(s2.shape, dtype=np.uint8)
    scale_codes = np.clip(np.rint(s1 / s2[np.arange(n) // group2].astype(np.float32)), 1, 255).astype(np.uint8)
    s1q = first_scale(scale_codes, s2, zero2, group2)
    zero = np.clip(np.rint(-lo_v / s1q), 0, qmax).astype(np.uint8)
    step = np.repeat(s1q, group, axis=1)
    zfull = np.repeat(zero, group, axis=1).astype(np.float32)
    codes = np.clip(np.rint(wf / step) + zfull, 0, np.repeat(qmax, group, axis=1)).astype(np.uint8)
    codes[mask] = zfull[mask].astype(np.uint8)
    rr, cc = np.nonzero(mask)
    rowptr = np.concatenate([[0], np.cumsum(np.bincount(rr, minlength=n))]).astype(np.int32)
    value = wf[rr, cc].astype(np.float16)
    full = MixWeight(codes, wide.astype(np.int64), zero, scale_codes, s2, zero2, rowptr, cc.astype(np.int32),
                     value, group, group2)  # fmt: skip
    full.validate()
    return full, wf


def compile_mixprec(key: MixKey, targets: tuple[int, ...] = TARGETS) -> dict[str, Any]:
    """AOT-compile every kernel of ``key`` (``decode`` at ``SPLIT_K`` 1 and 4) for each ``sm_<cc>``, as
    ``aot.compile_key`` does: per target and kernel, shared memory, warps, and the PTX and cubin sizes."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the 3.9 default, stated (as aot.py does)
    mod = kernel_module(key, False)
    evidence: dict[str, Any] = {}
    for cc in targets:
        per_target: dict[str, Any] = {}
        for fn, cfg in launch(key).items():
            sig = dict(params(key, fn))
            consts = {a: v for a, v in cfg.items() if a.isupper() and a in sig}
            for split in DECODE_SPLITS if fn == "decode" else (None,):
                full = consts | ({"SPLIT_K": split} if split else {})
                compiled: Any = triton.compile(
                    ASTSource(getattr(mod, fn), signature=sig, constexprs=full),
                    target=GPUTarget("cuda", cc, 32),
                    options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
                )
                per_target[fn if split is None else f"{fn}[SPLIT_K={split}]"] = {
                    "shared_bytes": int(compiled.metadata.shared),
                    "num_warps": int(compiled.metadata.num_warps),
                    "ptx_chars": len(compiled.asm["ptx"]),
                    "cubin_sha256": hashlib.sha256(compiled.asm["cubin"]).hexdigest(),
                }
        evidence[f"sm_{cc}"] = per_target
    return {"triton": triton.__version__, "targets": evidence}
