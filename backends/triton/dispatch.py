"""What ``qcompiler verify`` reports for a triton artifact: which kernels it brings, where they were
compiled, whether this machine can run them, and their operator parity on Triton's CPU interpreter
(fp16/fp32 kernels) and, when a CUDA device is present, on it.

Without a CUDA device the report says so plainly (the kernels need CUDA capability >= 8.0) and still
checks every kernel on the interpreter; the rest of the artifact verifies through the ordinary gates
and rungs either way.
"""

from __future__ import annotations

from typing import Any

import torch

from qcompiler.artifact.request import OpenedArtifact
from qcompiler.backends.triton.kinds import interpretable, kind_of
from qcompiler.backends.triton.parity import KernelParity
from qcompiler.backends.triton.plan import op_keys
from qcompiler.backends.triton.read import aot_targets
from qcompiler.ir.ops.quant import weight_name


def cuda_line() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device on this machine: the generated kernels need CUDA capability >= 8.0 to run"
    p = torch.cuda.get_device_properties(0)
    return (
        f"CUDA device {p.name} (capability {p.major}.{p.minor}): qcompiler.load(path, device='cuda') runs the kernels"
    )


BF16_NOTE = (
    "bf16 kernel: not run on the interpreter (its bf16 arithmetic works on raw bits); compiled for the GPU "
    "targets above, checked on a CUDA device when one is present"
)


def as_row(c: KernelParity) -> dict[str, Any]:
    return {"function": c.kernel, "rel_kernel": c.rel_kernel, "bound": c.bound, "ok": c.ok}


def report(opened: OpenedArtifact) -> dict[str, Any]:
    m = opened.module
    aot = aot_targets(opened.path)  # the index as the reader gate checked it: an ArtifactError, never a KeyError
    done: set[str] = set()
    kernels: list[dict[str, Any]] = []
    for _, w, key in op_keys(m):
        if key.id in done:
            continue
        done.add(key.id)
        t = w.result.quant
        assert t is not None
        kind = kind_of(key)
        on_interpreter = interpretable(key)  # the interpreter's bf16 is raw bits
        checks = kind.parity(m, w, t, key, None) if on_interpreter else []
        on_gpu = kind.parity(m, w, t, key, "cuda") if torch.cuda.is_available() else []
        kernels.append(
            {
                "kernel": key.id,
                "kind": kind.name,
                "checked_on": weight_name(w),
                "aot": aot.get(key.id, []),
                "interpreter": [as_row(c) for c in checks],
                **({} if on_interpreter else {"note": BF16_NOTE}),
                "cuda": [as_row(c) for c in on_gpu],
            }
        )
    ok = all(c["ok"] for k in kernels for c in k["interpreter"] + k["cuda"])
    return {
        "runtime": f"generated Triton kernels (codegen index: {len(aot)} kernel modules)",
        "cuda": cuda_line(),
        "kernels": kernels,
        "ok": ok,
    }
