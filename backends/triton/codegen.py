"""Triton source generated from a quantized op's signature: specialised, readable, deterministic.

A ``KernelKey`` is everything a kernel is specialised on (op, code bits and signedness, group size,
zero point, act-order permutation, activation / scale / output dtypes, bias, float8 codes). ``generate(key)``
returns the source of one Python module holding, for ``q.linear``:

- ``decode``: split-K GEMM for small M (``BLOCK_M = 16``); each program reduces one slice of K
  into fp32 partials ``ws [SPLIT_K, M, N]`` (or, with ``SPLIT_K = 1``, applies the epilogue itself);
- ``reduce``: sums the partials and applies the epilogue (per-channel scale, bias, output dtype);
- ``prefill``: tiled GEMM with grouped program order (L2 reuse of weight tiles) and the epilogue fused;

and for ``q.embedding`` a ``gather`` kernel that decodes only the looked-up rows.

Dequantization is fused in the inner loop: the codes come from the ``triton-kn`` layout (``u8
[K / per, N]``, ``per = 8 / bits`` codes per byte along K, offset binary), so a tile is
``(byte >> shift) & mask`` minus the offset, minus the zero point, times the group's scale, cast to
the dot's dtype, accumulated in fp32. Float8 codes (``f8e4m3``) are the same bytes, each turned
into its E4M3FN value from its bit fields before the scale. Everything the key fixes (bit widths,
masks, the group, which qparams exist) is written into the source as literals and dead branches are not emitted; block
sizes are ``tl.constexpr`` parameters whose values are in ``launch(key)``. Only Triton builtins are
called (no ``tl.cdiv``/``tl.zeros``: those are ``@triton.jit`` library functions, which the CPU
interpreter cannot call unless it was switched on before ``triton`` was imported).

The loader never runs source it read from an artifact: it regenerates the source from the key and
requires it to be byte-identical to the artifact's file (``CODEGEN_VERSION`` is part of the text).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

CODEGEN_VERSION = 1
TL_DTYPE = {"f16": "tl.float16", "bf16": "tl.bfloat16", "f32": "tl.float32"}
PTR_TYPE = {"f16": "*fp16", "bf16": "*bf16", "f32": "*fp32"}
BITS = (2, 4, 8)


@dataclass(frozen=True)
class KernelKey:
    """What one generated kernel module is specialised on."""

    op: str
    """``linear`` or ``embedding``."""
    bits: int
    signed: bool
    group: int
    """Group size along K; 0 when per channel (one group spans K)."""
    zero: bool
    perm: bool
    act: str
    """Activation dtype (``linear``); the output dtype for ``embedding``."""
    scale: str
    out: str
    bias: bool
    float8: bool = False
    """Codes are float8 E4M3FN bit patterns (family ``f8e4m3``; 8 bits, unsigned, no zero point)."""

    @property
    def per(self) -> int:
        return 8 // self.bits

    @property
    def offset(self) -> int:
        return 1 << (self.bits - 1) if self.signed else 0

    @property
    def id(self) -> str:
        group = f"g{self.group}" if self.group else "ch"
        parts = [
            f"q{self.op}",
            "f8e4m3" if self.float8 else f"{'i' if self.signed else 'u'}{self.bits}",
            group,
            "asym" if self.zero else "sym",
            *(["perm"] if self.perm else []),
            f"a{self.act}",
            f"s{self.scale}",
            f"o{self.out}",
            *(["bias"] if self.bias else []),
        ]
        return "_".join(parts)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.float8:  # the keys of integer kernels read as they did before FP8 existed
            del d["float8"]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KernelKey:
        return KernelKey(**d)


def block_k(key: KernelKey) -> int:
    """The K tile: at most 128 (64 for fp32 activations, whose tiles take twice the shared memory),
    and never past a group (one scale row per tile)."""
    widest = 64 if key.act == "f32" else 128
    return min(key.group, widest) if key.group else widest


def launch(key: KernelKey) -> dict[str, dict[str, int]]:
    """Per kernel: its ``tl.constexpr`` block sizes and launch options (``num_warps``, ``num_stages``)."""
    bk = block_k(key)
    if key.op == "embedding":
        return {"gather": {"BLOCK_K": 256, "num_warps": 4, "num_stages": 1}}
    return {
        "decode": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": bk, "num_warps": 4, "num_stages": 4},
        "reduce": {"BLOCK": 512, "num_warps": 4, "num_stages": 1},
        "prefill": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    }


def params(key: KernelKey, fn: str) -> list[tuple[str, str]]:
    """The kernel's parameters in order, each with its AOT signature type (``constexpr`` for block sizes)."""
    qp = [("q_ptr", "*u8"), ("s_ptr", PTR_TYPE[key.scale])]
    qp += [("z_ptr", "*i32")] if key.zero else []
    qp += [("p_ptr", "*i32")] if key.perm else []
    epi = [("s_ptr", PTR_TYPE[key.scale])] if not key.group else []
    epi += [("b_ptr", PTR_TYPE[key.out])] if key.bias else []
    blocks = [(name, "constexpr") for name in launch(key)[fn] if name.isupper()]
    if fn == "gather":
        return [("ids_ptr", "*i64"), *qp, ("y_ptr", PTR_TYPE[key.out]), ("N", "i32"), ("K", "i32"), *blocks]
    if fn == "reduce":
        return [
            ("ws_ptr", "*fp32"),
            *epi,
            ("y_ptr", PTR_TYPE[key.out]),
            ("M", "i32"),
            ("N", "i32"),
            ("SPLIT_K", "i32"),
            *blocks,
        ]
    x = [("x_ptr", PTR_TYPE[key.act])]
    extra = [("b_ptr", PTR_TYPE[key.out])] if key.bias else []
    out = [("y_ptr", PTR_TYPE[key.out])] + ([("ws_ptr", "*fp32")] if fn == "decode" else [])
    size = [("M", "i32"), ("N", "i32"), ("K", "i32")]
    split = [("SPLIT_K", "constexpr")] if fn == "decode" else []
    return [*x, *qp, *extra, *out, *size, *blocks, *split]


def functions(key: KernelKey) -> dict[str, dict[str, Any]]:
    """Each kernel's parameters (name, AOT type) and launch configuration, as ``kernels/index.json`` lists them."""
    return {fn: {"params": [list(p) for p in params(key, fn)], "launch": cfg} for fn, cfg in launch(key).items()}


def signature_line(key: KernelKey, fn: str) -> str:
    return ", ".join(f"{name}: tl.constexpr" if kind == "constexpr" else name for name, kind in params(key, fn))


def dequant(key: KernelKey, k: str, n: str, row_mask: str, indent: str) -> list[str]:
    """Lines decoding the ``[len(k), len(n)]`` tile ``w`` (fp32) from the packed codes."""
    lines = [
        f"packed = tl.load(q_ptr + ({k} // {key.per})[:, None] * N + {n}[None, :], mask={row_mask}, other=0)",
        f"code = ((packed.to(tl.int32) >> (({k} % {key.per}) * {key.bits})[:, None]) & {(1 << key.bits) - 1})"
        + (f" - {key.offset}" if key.offset else ""),
    ]
    if key.group:
        lines.append(f"g = k0 // {key.group}")
        lines.append("s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)")
    if key.zero:
        lines.append(
            f"z = tl.load(z_ptr + {'g' if key.group else '0'} * N + offs_n, mask=mask_n, other=0).to(tl.int32)"
        )
        lines.append("code = code - z[None, :]")
    value = "code.to(tl.float32)"
    if key.float8:
        lines += float8_value("code")
        value = "val"
    lines.append(f"w = {value}" + (" * s[None, :]" if key.group else ""))
    return [indent + line for line in lines]


def float8_value(code: str) -> list[str]:
    """Lines setting ``val`` (fp32) to the E4M3FN value of the int32 bit patterns ``code``: a normal
    value's fp32 bits are built from its fields (exponent ``e - 7 + 127``, mantissa on top), a
    subnormal is ``m * 2^-9``; exact, with no table and no float8 type (the CPU interpreter has none)."""
    return [
        f"e = ({code} >> 3) & 15",
        f"m = {code} & 7",
        "normal = ((e + 120) * 8388608 + m * 1048576).to(tl.float32, bitcast=True)",
        "mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)",
        f"val = tl.where({code} >= 128, -mag, mag)",
    ]


def k_loop(key: KernelKey, start: str, end: str) -> list[str]:
    dot = 'tl.dot(x, w, input_precision="tf32x3")' if key.act == "f32" else f"tl.dot(x, w.to({TL_DTYPE[key.act]}))"
    xk = "tl.load(p_ptr + offs_k, mask=mask_k, other=0)" if key.perm else "offs_k"
    return [
        f"    for k0 in range({start}, {end}, BLOCK_K):",
        "        offs_k = k0 + tl.arange(0, BLOCK_K)",
        "        mask_k = offs_k < K",
        f"        xk = {xk}",
        "        x_mask = mask_m[:, None] & mask_k[None, :]",
        "        x = tl.load(x_ptr + offs_m[:, None] * K + xk[None, :], mask=x_mask, other=0.0)",
        *dequant(key, "offs_k", "offs_n", "mask_k[:, None] & mask_n[None, :]", "        "),
        f"        acc += {dot}",
    ]


def epilogue(key: KernelKey, n: str, mask_n: str, indent: str, widen: str) -> list[str]:
    """Per-channel scale and bias on ``acc`` (``widen`` broadcasts a row over a 2-D tile)."""
    lines: list[str] = []
    if not key.group:
        lines.append(f"acc = acc * tl.load(s_ptr + {n}, mask={mask_n}, other=0).to(tl.float32){widen}")
    if key.bias:
        lines.append(f"acc = acc + tl.load(b_ptr + {n}, mask={mask_n}, other=0).to(tl.float32){widen}")
    return [indent + line for line in lines]


def decode_kernel(key: KernelKey) -> list[str]:
    return [
        "@triton.jit",
        f"def decode({signature_line(key, 'decode')}):",
        '    """Split-K GEMM for small M: program (tile, k-slice) -> fp32 partials (or y when SPLIT_K == 1)."""',
        "    pid = tl.program_id(0)",
        "    pid_k = tl.program_id(1)",
        "    num_n = (N + BLOCK_N - 1) // BLOCK_N",
        "    offs_m = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)",
        "    mask_m = offs_m < M",
        "    mask_n = offs_n < N",
        "    k_split = ((K + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K * BLOCK_K",
        "    k_start = pid_k * k_split",
        "    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)",
        *k_loop(key, "k_start", "tl.minimum(k_start + k_split, K)"),
        "    mask = mask_m[:, None] & mask_n[None, :]",
        "    if SPLIT_K == 1:",
        *epilogue(key, "offs_n", "mask_n", "        ", "[None, :]"),
        f"        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to({TL_DTYPE[key.out]}), mask=mask)",
        "    else:",
        "        tl.store(ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)",
    ]


def reduce_kernel(key: KernelKey) -> list[str]:
    return [
        "@triton.jit",
        f"def reduce({signature_line(key, 'reduce')}):",
        '    """Sum the split-K partials ws [SPLIT_K, M, N], apply the epilogue, store y [M, N]."""',
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
        "    mask = offs < M * N",
        "    acc = tl.full((BLOCK,), 0.0, tl.float32)",
        "    for s in range(0, SPLIT_K):",
        "        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)",
        "    n = offs % N",
        *epilogue(key, "n", "mask", "    ", ""),
        f"    tl.store(y_ptr + offs, acc.to({TL_DTYPE[key.out]}), mask=mask)",
    ]


def prefill_kernel(key: KernelKey) -> list[str]:
    return [
        "@triton.jit",
        f"def prefill({signature_line(key, 'prefill')}):",
        '    """Tiled GEMM, programs in groups of GROUP_M row tiles (weight tiles reused from L2), epilogue fused."""',
        "    pid = tl.program_id(0)",
        "    num_m = (M + BLOCK_M - 1) // BLOCK_M",
        "    num_n = (N + BLOCK_N - 1) // BLOCK_N",
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
        *k_loop(key, "0", "K"),
        *epilogue(key, "offs_n", "mask_n", "    ", "[None, :]"),
        f"    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to({TL_DTYPE[key.out]}), "
        "mask=mask_m[:, None] & mask_n[None, :])",
    ]


def gather_kernel(key: KernelKey) -> list[str]:
    lines = [
        "@triton.jit",
        f"def gather({signature_line(key, 'gather')}):",
        '    """Embedding rows: program (token, K tile) decodes row ids[token] of the [N, K] table."""',
        "    t = tl.program_id(0)",
        "    row = tl.load(ids_ptr + t)",
        "    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)",
        "    mask_k = offs_k < K",
        f"    packed = tl.load(q_ptr + (offs_k // {key.per}) * N + row, mask=mask_k, other=0)",
        f"    code = ((packed.to(tl.int32) >> ((offs_k % {key.per}) * {key.bits})) & {(1 << key.bits) - 1})"
        + (f" - {key.offset}" if key.offset else ""),
    ]

    def qparam(ptr: str) -> str:  # a group's value per element, or the row's one value per channel
        if key.group:
            return f"tl.load({ptr} + (offs_k // {key.group}) * N + row, mask=mask_k, other=0)"
        return f"tl.load({ptr} + row)"

    if key.zero:
        lines.append(f"    code = code - {qparam('z_ptr')}.to(tl.int32)")
    lines.append(f"    val = code.to(tl.float32) * {qparam('s_ptr')}.to(tl.float32)")
    dest = "tl.load(p_ptr + offs_k, mask=mask_k, other=0)" if key.perm else "offs_k"
    lines.append(f"    tl.store(y_ptr + t * K + {dest}, val.to({TL_DTYPE[key.out]}), mask=mask_k)")
    return lines


def header(key: KernelKey) -> list[str]:
    return [
        f'"""qcompiler generated kernels: {key.id} (codegen v{CODEGEN_VERSION}).',
        "",
        f"op={key.op} bits={key.bits} signed={key.signed} group={key.group or 'channel'} zero={key.zero} "
        f"perm={key.perm} act={key.act} scale={key.scale} out={key.out} bias={key.bias}"
        + (" float8=e4m3fn" if key.float8 else ""),
        f"codes: triton-kn v1, u8 [K/{key.per}, N], code k at bits {key.bits}*(k % {key.per}), "
        f"offset {key.offset}; scale [groups, N]; zero i32 [groups, N]; "
        "perm i32 [K] (stored column j reads x[perm[j]])",
        '"""',
        "",
        "import triton",
        "import triton.language as tl",
        "",
    ]


def generate(key: KernelKey) -> str:
    """The kernel module's source for ``key`` (see the module docstring)."""
    if key.bits not in BITS:
        raise ValueError(f"{key.id}: codegen emits 2, 4 or 8-bit codes, not {key.bits}")
    if key.float8 and (key.bits != 8 or key.signed or key.zero or key.op != "linear"):
        raise ValueError(f"{key.id}: float8 codes are unsigned 8-bit patterns of a linear weight, no zero point")
    bodies = (
        [gather_kernel(key)] if key.op == "embedding" else [decode_kernel(key), reduce_kernel(key), prefill_kernel(key)]
    )
    lines = header(key)
    for body in bodies:
        lines += ["", *body, ""]
    return "\n".join(lines).rstrip() + "\n"


def source_sha256(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()
