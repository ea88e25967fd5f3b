"""Ahead-of-time compilation of generated kernels for CUDA targets, without a GPU.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc, 32))`` lowers a
kernel through TTIR, TTGIR, LLVM IR and PTX to a cubin with the bundled ``ptxas``. ``compile_key``
does that for every kernel of a key (``decode`` at ``SPLIT_K`` 1 and 4, since each value is its own
binary) and returns the evidence the artifact records: per target and kernel, the shared memory,
registers spilled, and the cubin's sha256.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qcompiler.backends.triton.codegen import KernelKey, launch, params
from qcompiler.backends.triton.jit import kernel_module

TARGETS = (80, 90)
"""Compute capabilities every generated kernel is compiled for (Ampere sm_80, Hopper sm_90)."""
DECODE_SPLITS = (1, 4)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
"""Shared memory one block may use (opt-in maximum) per target: a kernel past it cannot launch there."""


def variants(key: KernelKey) -> list[tuple[str, dict[str, int]]]:
    """(kernel, constexprs) for each binary a key needs."""
    out: list[tuple[str, dict[str, int]]] = []
    for fn, cfg in launch(key).items():
        consts = {name: cfg[name] for name, kind in params(key, fn) if kind == "constexpr" and name in cfg}
        splits = DECODE_SPLITS if fn == "decode" else (None,)
        out += [(fn if s is None else f"{fn}[SPLIT_K={s}]", consts | ({"SPLIT_K": s} if s else {})) for s in splits]
    return out


def compile_key(key: KernelKey, targets: tuple[int, ...] = TARGETS) -> dict[str, Any]:
    """Compile every kernel of ``key`` for each ``sm_<cc>`` target; raises on any compile error."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the 3.9 default, stated (3.10 flips it)
    mod = kernel_module(key)
    evidence: dict[str, Any] = {}
    for cc in targets:
        per_target: dict[str, Any] = {}
        for name, consts in variants(key):
            fn = name.partition("[")[0]
            cfg = launch(key)[fn]
            compiled: Any = triton.compile(
                ASTSource(getattr(mod, fn), signature=dict(params(key, fn)), constexprs=consts),
                target=GPUTarget("cuda", cc, 32),
                options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
            )
            if int(compiled.metadata.shared) > SHARED_LIMIT[cc]:
                raise ValueError(
                    f"{key.id} {name}: {compiled.metadata.shared} bytes of shared memory exceed sm_{cc}'s "
                    f"{SHARED_LIMIT[cc]}"
                )
            per_target[name] = {
                "shared_bytes": int(compiled.metadata.shared),
                "num_warps": int(compiled.metadata.num_warps),
                "cubin_sha256": hashlib.sha256(compiled.asm["cubin"]).hexdigest(),
            }
        evidence[f"sm_{cc}"] = per_target
    return {"triton": triton.__version__, "targets": evidence}
