"""What ``qcompiler verify`` reports for a triton artifact: which kernels it brings, where they were
compiled, whether this machine can run them, and their operator parity on Triton's CPU interpreter.

Without a CUDA device the report says so plainly (the kernels need CUDA capability >= 8.0) and still
checks every kernel on the interpreter; the rest of the artifact verifies through the ordinary gates
and rungs either way.
"""

from __future__ import annotations

from typing import Any

import torch

from qcompiler.artifact.reader import read_json
from qcompiler.artifact.request import OpenedArtifact
from qcompiler.backends.triton.parity import kernel_parity
from qcompiler.backends.triton.plan import INDEX_FILE, op_keys, weight_name
from qcompiler.ir.blobs import read_array
from qcompiler.parity import decoded


def cuda_line() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device on this machine: the generated kernels need CUDA capability >= 8.0 to run"
    p = torch.cuda.get_device_properties(0)
    return (
        f"CUDA device {p.name} (capability {p.major}.{p.minor}): qcompiler.load(path, device='cuda') runs the kernels"
    )


def report(opened: OpenedArtifact) -> dict[str, Any]:
    m = opened.module
    index = read_json(opened.path / INDEX_FILE, INDEX_FILE)
    aot = {e["id"]: sorted((e.get("aot") or {}).get("targets", {})) for e in index["kernels"]}
    done: set[str] = set()
    kernels: list[dict[str, Any]] = []
    for _, w, key in op_keys(m):
        if key.id in done:
            continue
        done.add(key.id)
        t = w.result.quant
        assert t is not None

        arrays = {
            s: read_array(m, str(w.attrs[s]).removeprefix("@"))
            for s in ("codes", "scale", "zero", "perm")
            if s in w.attrs
        }
        checks = kernel_parity(
            key, arrays["codes"], arrays["scale"], arrays.get("zero"), arrays.get("perm"), decoded(m, w, t)
        )
        kernels.append(
            {
                "kernel": key.id,
                "checked_on": weight_name(w),
                "aot": aot.get(key.id, []),
                "interpreter": [
                    {"function": c.kernel, "rel_kernel": c.rel_kernel, "bound": c.bound, "ok": c.ok} for c in checks
                ],
            }
        )
    ok = all(c["ok"] for k in kernels for c in k["interpreter"])
    return {
        "runtime": f"generated Triton kernels (codegen index: {len(index['kernels'])} kernel modules)",
        "cuda": cuda_line(),
        "kernels": kernels,
        "ok": ok,
    }
