"""Triton source for intra-weight mixed 2/4-bit weights with fp16 outliers and second-level-quantized scales.

The layout (``("mixprec", 1, "planes-a16")``, after arXiv 2311.16442): a weight ``W [N, K]`` in groups
of ``G`` along K; most groups hold 2-bit codes, some (``wide``) 4-bit codes; every group has a u8 zero
point and a first-level scale ``s1`` that is itself quantized per group of ``G2`` rows:
``s1 = float32(float32(scale_codes) - float32(zero2)) * float32(scale2)``; a sparse set of fp16
outliers sits in 2-bit groups where the code equals the zero point (the affine part is exactly 0 there,
so replacing the element and adding its value are the same). The kernel reads the container's planes
plus a load-time repack (``mixprec_run.prepare`` builds it; every per-group array is transposed to
``[K / G, rows]`` so a tile's loads are contiguous along N; ``BLOCK_N`` is the repack's tile):

- ``lo`` u8 ``[N, K / 4]``: bits 0-1 of every code, row-major, 4 codes per byte, LSB first;
- ``hi`` u8 ``[n4, G / 4]``: bits 2-3 of the codes of the 4-bit groups, reordered column-major (by
  group column ``g``, then row), so the 4-bit groups of one column within an N tile are consecutive;
- ``hbase`` i32 ``[K / G, ceil(N / BLOCK_N)]``: the ``hi`` row of the first 4-bit group of column ``g``
  in N tile ``t``; ``hrank`` u8 ``[K / G, N]``: a group's rank among the tile's 4-bit groups of its column
  (``hi`` row = ``hbase + hrank``), 255 for a 2-bit group (one byte per group, not an int32 index);
- ``zero``, ``sc`` (scale codes) u8 ``[K / G, N]``; ``s2`` f16 and ``z2`` u8 ``[K / G, ceil(N / G2)]``;
- outliers as CSR over output rows (``rp`` i32 ``[N + 1]``, ``col`` i32, ``val`` f16) plus ``tn`` i32
  ``[ceil(N / BLOCK_N)]``, the largest row count of each N tile (the correction loop's trip count).

Kernels (``generate_mixprec(key)``): ``decode`` (split-K GEMM for M <= 16, fp32 partials ``ws [SPLIT_K,
M, N]``), ``reduce`` (sums the partials, bias, output dtype) and ``prefill`` (tiled GEMM, grouped order).
A tile ``[BLOCK_N, BLOCK_K]`` never crosses a group (``BLOCK_K`` divides ``G``). Each K step is written in
the paper's "asynchronous dequantization" order as far as Triton source can say it: first the code loads
of the tile are issued (low plane, high-plane rank and base, high plane, activations), then the second-level
parameters are loaded and ``s1`` decoded, and only then are the codes combined (``lo | hi << 2``), the
zero subtracted and ``s1`` applied; the scale decode has no dependence on the code loads, so it runs
while they are in flight. The outlier correction is folded into the tile's epilogue (``decode``: the
``pid_k == 0`` slice adds it to its partials; ``prefill``: before the bias), ``acc[:, r] += x[:, col] *
val`` over the tile's CSR rows in fp32. As in ``codegen``, only Triton builtins are called (the
interpreter constraint), everything the key fixes is a literal, and the source is deterministic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from qcompiler.backends.triton.codegen import PTR_TYPE, TL_DTYPE

MIXPREC_CODEGEN_VERSION = 1
LAYOUT = ("mixprec", 1, "planes-a16")
PRECISIONS = frozenset({2, 4})
"""Code widths the kernels decode (the fp16 outliers are exceptions, not a precision of the map)."""
NESTED_SLOTS = ("scale_codes", "scale2", "zero2")
"""The second-level quantization of the first-level scales: all three must be present."""
EXCEPTIONS = "replacement"
DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}


@dataclass(frozen=True)
class MixKey:
    """What one generated mixed-precision kernel module is specialised on."""

    act: str
    out: str
    group: int
    """First-level group size along K (a multiple of 16)."""
    group2: int
    """Rows per second-level group (the scale quantizer's group along N)."""
    bias: bool = False
    outliers: bool = True
    """Whether the outlier correction is emitted (a weight with no outliers may drop it)."""

    @property
    def id(self) -> str:
        parts = [f"qlinear_mix24_g{self.group}_s2g{self.group2}", f"a{self.act}", f"o{self.out}"]
        return "_".join(parts + (["outl"] if self.outliers else []) + (["bias"] if self.bias else []))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def block_k(key: MixKey) -> int:
    """The K tile: the largest power of two dividing the group, at most 128 (64 for fp32 activations)."""
    widest = 64 if key.act == "f32" else 128
    return min(key.group & -key.group, widest)


def launch(key: MixKey) -> dict[str, dict[str, int]]:
    """Per kernel: its ``tl.constexpr`` block sizes and launch options; ``BLOCK_N`` is shared (the repack's tile)."""
    bk = block_k(key)
    return {
        "decode": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": bk, "num_warps": 4, "num_stages": 4},
        "reduce": {"BLOCK": 512, "num_warps": 4, "num_stages": 1},
        "prefill": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    }


def params(key: MixKey, fn: str) -> list[tuple[str, str]]:
    """The kernel's parameters in order, each with its AOT signature type (``constexpr`` for block sizes)."""
    blocks = [(name, "constexpr") for name in launch(key)[fn] if name.isupper()]
    bias = [("b_ptr", PTR_TYPE[key.out])] if key.bias else []
    if fn == "reduce":
        sizes = [("M", "i32"), ("N", "i32"), ("SPLIT_K", "i32")]
        return [("ws_ptr", "*fp32"), *bias, ("y_ptr", PTR_TYPE[key.out]), *sizes, *blocks]
    weight = [("lo_ptr", "*u8"), ("hi_ptr", "*u8"), ("hbase_ptr", "*i32"), ("hrank_ptr", "*u8"), ("z_ptr", "*u8")]
    weight += [("sc_ptr", "*u8")]
    weight += [("s2_ptr", "*fp16"), ("z2_ptr", "*u8")]
    if key.outliers:
        weight += [("rp_ptr", "*i32"), ("col_ptr", "*i32"), ("val_ptr", "*fp16"), ("tn_ptr", "*i32")]
    out = [("y_ptr", PTR_TYPE[key.out])] + ([("ws_ptr", "*fp32")] if fn == "decode" else [])
    split = [("SPLIT_K", "constexpr")] if fn == "decode" else []
    sizes = [("M", "i32"), ("N", "i32"), ("K", "i32")]
    return [("x_ptr", PTR_TYPE[key.act]), *weight, *bias, *out, *sizes, *blocks, *split]


def signature_line(key: MixKey, fn: str) -> str:
    return ", ".join(f"{name}: tl.constexpr" if kind == "constexpr" else name for name, kind in params(key, fn))


def k_step(key: MixKey) -> list[str]:
    """One K tile: issue the code loads, decode the second-level scale, then combine and accumulate."""
    g, gb, g2 = key.group, key.group // 4, key.group2
    dot = "tl.dot(x, tl.trans(w), input_precision=\"tf32x3\")" if key.act == "f32" else (
        f"tl.dot(x, tl.trans(w.to({TL_DTYPE[key.act]})))"
    )  # fmt: skip
    lines = [
        f"g = k0 // {g}",
        "offs_kb = k0 // 4 + tl.arange(0, BLOCK_K // 4)",
        "# 1. the code loads of the tile: low plane, high-plane rank and base, high plane, activations",
        "lo = tl.load(lo_ptr + offs_n[:, None] * (K // 4) + offs_kb[None, :], mask=mask_n[:, None], other=0)",
        "rk = tl.load(hrank_ptr + g * N + offs_n, mask=mask_n, other=255)",
        "h = tl.load(hbase_ptr + g * num_n + pid_n) + rk.to(tl.int32)",
        f"hi = tl.load(hi_ptr + h[:, None] * {gb} + (offs_kb - g * {gb})[None, :], mask=(rk != 255)[:, None], other=0)",
        "offs_k = k0 + tl.arange(0, BLOCK_K)",
        "x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None], other=0.0)",
        "# 2. while they are in flight: the first-level scale from its codes and the second level",
        "sc = tl.load(sc_ptr + g * N + offs_n, mask=mask_n, other=0)",
        f"s2 = tl.load(s2_ptr + g * N2 + offs_n // {g2}, mask=mask_n, other=0)",
        f"z2 = tl.load(z2_ptr + g * N2 + offs_n // {g2}, mask=mask_n, other=0)",
        "s1 = (sc.to(tl.float32) - z2.to(tl.float32)) * s2.to(tl.float32)",
        "z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.int32)",
        "# 3. combine: code = lo | hi << 2, minus the zero, times s1; 4 codes per byte, LSB first",
        "lo = lo.to(tl.int32)",
        "hi = hi.to(tl.int32)",
    ]
    for j in range(4):
        sh = 2 * j
        lo_j = f"(lo >> {sh}) & 3" if sh else "lo & 3"
        hi_j = f"((hi >> {sh}) & 3) << 2" if sh else "(hi & 3) << 2"
        lines.append(f"w{j} = ((({lo_j}) | ({hi_j})) - z[:, None]).to(tl.float32) * s1[:, None]")
    lines += [
        "w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_N, BLOCK_K))",
        f"acc += {dot}",
    ]
    return lines


def outlier_lines(key: MixKey) -> list[str]:
    """``acc[m, r] += x[m, col] * val`` over the CSR rows of the tile (``tn``: the tile's longest row)."""
    if not key.outliers:
        return []
    return [
        "start = tl.load(rp_ptr + offs_n, mask=mask_n, other=0)",
        "count = tl.load(rp_ptr + 1 + offs_n, mask=mask_n, other=0) - start",
        "for j in range(0, tl.load(tn_ptr + pid_n)):",
        "    hit = j < count",
        "    col = tl.load(col_ptr + start + j, mask=hit, other=0)",
        "    val = tl.load(val_ptr + start + j, mask=hit, other=0).to(tl.float32)",
        "    xo = tl.load(x_ptr + offs_m[:, None] * K + col[None, :], mask=mask_m[:, None] & hit[None, :], other=0.0)",
        "    acc += xo.to(tl.float32) * val[None, :]",
    ]


def indent(lines: list[str], by: str) -> list[str]:
    return [by + line for line in lines]


def bias_line(key: MixKey, n: str, mask_n: str, widen: str) -> list[str]:
    if not key.bias:
        return []
    return [f"acc = acc + tl.load(b_ptr + {n}, mask={mask_n}, other=0).to(tl.float32){widen}"]


def decode_kernel(key: MixKey) -> list[str]:
    correction = outlier_lines(key)
    return [
        "@triton.jit",
        f"def decode({signature_line(key, 'decode')}):",
        '    """Split-K GEMM for small M: program (tile, k-slice) -> fp32 partials (or y when SPLIT_K == 1)."""',
        "    pid = tl.program_id(0)",
        "    pid_k = tl.program_id(1)",
        "    num_n = (N + BLOCK_N - 1) // BLOCK_N",
        f"    N2 = (N + {key.group2 - 1}) // {key.group2}",
        "    offs_m = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    pid_n = pid % num_n",
        "    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
        "    mask_m = offs_m < M",
        "    mask_n = offs_n < N",
        "    k_split = (K // BLOCK_K + SPLIT_K - 1) // SPLIT_K * BLOCK_K",
        "    k_start = pid_k * k_split",
        "    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)",
        "    for k0 in range(k_start, tl.minimum(k_start + k_split, K), BLOCK_K):",
        *indent(k_step(key), "        "),
        *(["    if pid_k == 0:", *indent(correction, "        ")] if correction else []),
        "    mask = mask_m[:, None] & mask_n[None, :]",
        "    if SPLIT_K == 1:",
        *indent(bias_line(key, "offs_n", "mask_n", "[None, :]"), "        "),
        f"        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to({TL_DTYPE[key.out]}), mask=mask)",
        "    else:",
        "        tl.store(ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)",
    ]


def reduce_kernel(key: MixKey) -> list[str]:
    return [
        "@triton.jit",
        f"def reduce({signature_line(key, 'reduce')}):",
        '    """Sum the split-K partials ws [SPLIT_K, M, N], add the bias, store y [M, N]."""',
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
        "    mask = offs < M * N",
        "    acc = tl.full((BLOCK,), 0.0, tl.float32)",
        "    for s in range(0, SPLIT_K):",
        "        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)",
        *indent(bias_line(key, "offs % N", "mask", ""), "    "),
        f"    tl.store(y_ptr + offs, acc.to({TL_DTYPE[key.out]}), mask=mask)",
    ]


def prefill_kernel(key: MixKey) -> list[str]:
    return [
        "@triton.jit",
        f"def prefill({signature_line(key, 'prefill')}):",
        '    """Tiled GEMM, programs in groups of GROUP_M row tiles (weight tiles reused from L2), epilogue fused."""',
        "    pid = tl.program_id(0)",
        "    num_m = (M + BLOCK_M - 1) // BLOCK_M",
        "    num_n = (N + BLOCK_N - 1) // BLOCK_N",
        f"    N2 = (N + {key.group2 - 1}) // {key.group2}",
        "    width = GROUP_M * num_n",
        "    first_m = (pid // width) * GROUP_M",
        "    size_m = tl.minimum(num_m - first_m, GROUP_M)",
        "    pid_m = first_m + (pid % width) % size_m",
        "    pid_n = (pid % width) // size_m",
        "    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
        "    mask_m = offs_m < M",
        "    mask_n = offs_n < N",
        "    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)",
        "    for k0 in range(0, K, BLOCK_K):",
        *indent(k_step(key), "        "),
        *indent(outlier_lines(key), "    "),
        *indent(bias_line(key, "offs_n", "mask_n", "[None, :]"), "    "),
        f"    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to({TL_DTYPE[key.out]}), "
        "mask=mask_m[:, None] & mask_n[None, :])",
    ]


def generate_mixprec(key: MixKey) -> str:
    """The kernel module's source for ``key`` (see the module docstring)."""
    if key.group <= 0 or key.group % 16:
        raise ValueError(f"{key.id}: the group size must be a positive multiple of 16, not {key.group}")
    if key.group2 <= 0:
        raise ValueError(f"{key.id}: the second-level group must be positive, not {key.group2}")
    if key.act not in TL_DTYPE or key.out not in TL_DTYPE:
        raise ValueError(f"{key.id}: activations and outputs are f16, bf16 or f32")
    cfg = launch(key)
    if cfg["decode"]["BLOCK_N"] != cfg["prefill"]["BLOCK_N"]:
        raise ValueError(f"{key.id}: decode and prefill share one BLOCK_N (hbase, tn are per N tile)")
    lines = [
        f'"""qcompiler generated kernels: {key.id} (mixprec codegen v{MIXPREC_CODEGEN_VERSION}).',
        "",
        f"layout {'/'.join(map(str, LAYOUT))}: act={key.act} out={key.out} group={key.group} group2={key.group2} "
        f"bias={key.bias} outliers={key.outliers}",
        "lo u8 [N, K/4] (bits 0-1, 4 codes per byte LSB first); hi u8 [n4, G/4] (bits 2-3 of the 4-bit groups);",
        "(column-major); hi row = hbase i32 [K/G, N tiles] + hrank u8 [K/G, N] (255: 2-bit group);",
        "zero, sc u8 [K/G, N]; s2 f16, z2 u8 [K/G, ceil(N/G2)];",
        "s1 = (sc - z2) * s2; w = (code - zero) * s1; outliers CSR rp/col/val, tn [ceil(N/BLOCK_N)]",
        '"""',
        "",
        "import triton",
        "import triton.language as tl",
        "",
    ]
    for body in (decode_kernel(key), reduce_kernel(key), prefill_kernel(key)):
        lines += ["", *body, ""]
    return "\n".join(lines).rstrip() + "\n"


def source_sha256(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def shared_estimate(key: MixKey, fn: str) -> int:
    """Shared memory bytes of a tile kernel, from its block sizes: ``num_stages`` buffers of each pipelined
    load (activations, low plane, high plane) plus both dot operands staged once (an upper estimate:
    the compiler may keep some of these in registers)."""
    cfg = launch(key)[fn]
    if "BLOCK_K" not in cfg:
        return 0
    bm, bn, bk, act = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], DTYPE_BYTES[key.act]
    per_stage = bm * bk * act + 2 * bn * bk // 4
    return cfg["num_stages"] * per_stage + (bm + bn) * bk * act


def register_estimate(key: MixKey, fn: str) -> int:
    """32-bit registers per thread: the fp32 accumulator, the fp32 decoded tile and the activation tile
    spread over the block's threads, plus 40 for addresses, masks and loop state."""
    cfg = launch(key)[fn]
    threads = 32 * cfg["num_warps"]
    if "BLOCK_K" not in cfg:
        return 40 + cfg["BLOCK"] // threads * 2
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    words = bm * bn + bn * bk + bm * bk * DTYPE_BYTES[key.act] // 4
    return 40 + -(-words // threads)


def admit_mixprec(
    key: MixKey,
    layout: tuple[str, int, str],
    precisions: Collection[int],
    slots: Collection[str],
    exceptions: str,
    local_k: int,
    device: Mapping[str, int],
    vector_k: int | None = None,
) -> str | None:
    """None if the kernels of ``key`` take this weight on this device, else why not.

    ``precisions``: the code widths of the weight's precision map; ``slots``: its qparam slots;
    ``local_k``: the K slice one program reduces (a shard's K); ``vector_k``: the kernel's K vector
    width (default ``BLOCK_K``); ``device``: ``max_shared_bytes``, ``registers_per_thread``,
    ``registers_per_sm``."""
    if tuple(layout) != LAYOUT:
        return f"layout {layout} is not {LAYOUT}"
    if not precisions or not set(precisions) <= PRECISIONS:
        return f"precision map {sorted(precisions)}: the kernels decode 2 and 4-bit codes only"
    missing = [s for s in ("zero", *NESTED_SLOTS) if s not in slots]
    if missing:
        return f"nested qparams missing: {', '.join(missing)} (the first-level scales must be second-level quantized)"
    if exceptions != EXCEPTIONS:
        return f"exception semantics {exceptions!r}: the kernels fold outliers as {EXCEPTIONS!r} on a zero base"
    vk = block_k(key) if vector_k is None else vector_k
    if local_k <= 0 or local_k % vk:
        return f"local K {local_k} is not a multiple of the vector width {vk}"
    if local_k % key.group:
        return f"local K {local_k} is not a whole number of groups of {key.group}"
    for fn in launch(key):
        cfg = launch(key)[fn]
        shared, regs = shared_estimate(key, fn), register_estimate(key, fn)
        if shared > device["max_shared_bytes"]:
            return f"{fn}: about {shared} bytes of shared memory exceed the device's {device['max_shared_bytes']}"
        if regs > device["registers_per_thread"]:
            return f"{fn}: about {regs} registers per thread exceed the device's {device['registers_per_thread']}"
        block = regs * 32 * cfg["num_warps"]
        if block > device["registers_per_sm"]:
            return f"{fn}: a block needs about {block} registers, the SM has {device['registers_per_sm']}"
    return None
