"""The generated kernels as runtime kernels: one ``KernelSpec`` per key and phase, registered for CUDA.

``specs(key)`` declares exactly what the generated module accepts (its key as admission fields, the
``triton-kn`` layout, ``min_capability`` 8.0) for the ``decode`` phase (split-K GEMM + reduce) and
the ``prefill`` phase (tiled GEMM); embeddings get one ``gather`` spec for both phases. The two
linear specs share one prepared weight (``shares``): the codes as stored (no repack), the scale and
zero point transposed once to ``[groups, N]`` (zero as int32), the permutation as int32, on the device.

``Place.interpret`` runs the same kernels through Triton's CPU interpreter on host tensors (slow:
tests and ``bench/gpu_kernels.py --interpret`` use it on small models).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from qcompiler.backends.triton.codegen import KernelKey, launch
from qcompiler.backends.triton.jit import kernel_module
from qcompiler.errors import UsageError
from qcompiler.ir.core import Module, Op
from qcompiler.ir.interpret import TORCH, Env
from qcompiler.ir.types import QuantType
from qcompiler.runtime.kernels import KernelSpec, Place, ensure_registered

MIN_CAPABILITY = 8.0
ERROR_BOUND = {"f32": 1e-4, "f16": 3e-3, "bf16": 2e-2}
"""Relative L2 error against the float64 decode: fp32 (TF32x3 on the GPU), fp16 and bf16 operands."""
MAX_SPLIT = 16
INT32_LIMIT = 2**31
"""The kernels index with int32 offsets: every operand and the output must stay below 2^31 elements."""


def ref_array(m: Module, op: Op, slot: str) -> torch.Tensor:
    return Env(m).tensor(op.attrs[slot])


def handle(
    key: KernelKey,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    perm: torch.Tensor | None,
    k: int,
    place: Place,
) -> dict[str, Any]:
    """A kernel's resident weight from the stored arrays: ``codes`` u8 ``[K / per, N]`` (``triton-kn``),
    ``scale`` and ``zero`` ``[N, groups]`` (transposed here), ``perm`` ``[K]``."""
    if place.interpret and "bf16" in (key.act, key.scale, key.out):
        raise UsageError(
            f"{key.id}: Triton's CPU interpreter computes bf16 on raw bits; bf16 kernels run on a CUDA device only"
        )
    dev = place.torch_device
    h: dict[str, Any] = {
        "q": codes.contiguous().to(dev),
        "s": scale.T.contiguous().to(dev),
        "n": int(codes.shape[1]),
        "k": k,
        "sms": place.sms,
        "module": kernel_module(key, place.interpret),
    }
    if key.zero:
        assert zero is not None
        h["z"] = zero.to(torch.int32).T.contiguous().to(dev)
    if key.perm:
        assert perm is not None
        h["p"] = perm.to(torch.int32).contiguous().to(dev)
    return h


def prepare_for(key: KernelKey) -> Any:
    def prepare(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
        arrays = {s: ref_array(m, op, s) if s in op.attrs else None for s in ("codes", "scale", "zero", "perm")}
        scale = arrays["scale"]
        assert arrays["codes"] is not None
        assert scale is not None
        return handle(key, arrays["codes"], scale, arrays["zero"], arrays["perm"], int(t.shape[1]), place)

    return prepare


def qparams(key: KernelKey, h: dict[str, Any]) -> list[Any]:
    return [h["q"], h["s"], *([h["z"]] if key.zero else []), *([h["p"]] if key.perm else [])]


def split_k(m: int, n: int, k: int, sms: int, cfg: dict[str, int]) -> int:
    """K slices for the decode kernel: enough programs for two waves over the SMs, at most one slice per K tile."""
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    k_tiles = -(-k // cfg["BLOCK_K"])
    split = 1
    while tiles * split < 2 * sms and split * 2 <= min(k_tiles, MAX_SPLIT):
        split *= 2
    return split


def options(cfg: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(constexprs, launch options) of a launch config."""
    opts = {k: v for k, v in cfg.items() if not k.isupper()}
    return {k: v for k, v in cfg.items() if k.isupper()}, opts


def run_linear(key: KernelKey, phase: str) -> Any:
    cfgs = launch(key)

    def run(h: dict[str, Any], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        mod: ModuleType = h["module"]
        n, k = h["n"], h["k"]
        lead = list(x.shape[:-1])
        x2 = x.reshape(-1, k).to(TORCH[key.act]).contiguous()
        m = x2.shape[0]
        if max(m * k, m * n, n * k) >= INT32_LIMIT:
            raise ValueError(f"{key.id}: [{m}, {k}] x [{n}, {k}] exceeds the kernels' int32 offsets; split the rows")
        y = torch.empty(m, n, dtype=TORCH[key.out], device=x2.device)
        b = [bias.to(TORCH[key.out]).contiguous()] if key.bias and bias is not None else []
        if key.bias and not b:
            raise ValueError(f"{key.id}: the kernel fuses a bias and none was given")
        if m == 0:
            return y.reshape([*lead, n])
        if phase == "prefill":
            consts, opts = options(cfgs["prefill"])
            grid = (-(-m // consts["BLOCK_M"]) * -(-n // consts["BLOCK_N"]),)
            mod.prefill[grid](x2, *qparams(key, h), *b, y, m, n, k, **consts, **opts)
            return y.reshape([*lead, n])
        consts, opts = options(cfgs["decode"])
        split = split_k(m, n, k, h["sms"], cfgs["decode"])
        ws = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else y
        grid = (-(-m // consts["BLOCK_M"]) * -(-n // consts["BLOCK_N"]), split)
        mod.decode[grid](x2, *qparams(key, h), *b, y, ws, m, n, k, **consts, SPLIT_K=split, **opts)
        if split > 1:
            rc, ropts = options(cfgs["reduce"])
            epi = ([h["s"]] if not key.group else []) + b
            mod.reduce[(-(-m * n // rc["BLOCK"]),)](ws, *epi, y, m, n, split, **rc, **ropts)
        return y.reshape([*lead, n])

    return run


def run_gather(key: KernelKey) -> Any:
    consts, opts = options(launch(key)["gather"])

    def run(h: dict[str, Any], ids: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = h["n"], h["k"]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise IndexError(f"{key.id}: token ids must lie in [0, {n}), found [{int(flat.min())}, {int(flat.max())}]")
        y = torch.empty(flat.numel(), k, dtype=TORCH[key.out], device=flat.device)
        if flat.numel():
            grid = (flat.numel(), -(-k // consts["BLOCK_K"]))
            h["module"].gather[grid](flat, *qparams(key, h), y, n, k, **consts, **opts)
        return y.reshape([*ids.shape, k])

    return run


def admission(key: KernelKey) -> dict[str, Any]:
    """What every kernel of ``key`` declares to the registry (the signature it accepts)."""
    return {
        "device": "cuda",
        "min_capability": MIN_CAPABILITY,
        "families": frozenset({"f8e4m3" if key.float8 else "affine"}),
        "codes": frozenset({f"{'i' if key.signed else 'u'}{key.bits}"}),
        "zero": "int" if key.zero else "none",
        "scale_dtypes": frozenset({key.scale}),
        "groups": frozenset({key.group}),
        "activations": frozenset({key.act}),
        "outputs": frozenset({key.out}),
        "epilogues": frozenset({"bias"}) if key.bias else frozenset(),
        "needs_bias": key.bias,
        "perm": "required" if key.perm else "none",
        "layouts": frozenset({"triton-kn/v1"}),
        "repack": "",
        "error_bound": ERROR_BOUND[key.act if key.op == "linear" else key.out],
    }


def phases(key: KernelKey) -> dict[str, frozenset[str]]:
    """Kernel id suffix -> the phases it serves."""
    if key.op == "embedding":
        return {"gather": frozenset({"prefill", "decode"})}
    return {"decode": frozenset({"decode"}), "prefill": frozenset({"prefill"})}


def admission_json(key: KernelKey) -> dict[str, Any]:
    """``admission`` per registered kernel id, as JSON (sets as sorted lists): what ``kernels/index.json`` says."""
    declared = {k: sorted(v) if isinstance(v, frozenset) else v for k, v in admission(key).items()}
    op = "q.embedding" if key.op == "embedding" else "q.linear"
    return {f"triton.{key.id}.{fn}": {"op": op, "phases": sorted(p), **declared} for fn, p in phases(key).items()}


def specs(key: KernelKey) -> list[KernelSpec]:
    """The registered kernels of ``key`` (already registered ones are returned as they are)."""
    common: dict[str, Any] = {**admission(key), "prepare": prepare_for(key), "shares": f"triton.{key.id}"}
    op = "q.embedding" if key.op == "embedding" else "q.linear"
    return [
        ensure_registered(
            KernelSpec(
                f"triton.{key.id}.{fn}",
                op,
                "packed",
                phases=served,
                run=run_gather(key) if fn == "gather" else run_linear(key, fn),
                **common,
            )
        )
        for fn, served in phases(key).items()
    ]
