"""Where a load's kernels run (``resolve_place``) and how narrow they may compute (``resolve_compute``)."""

from __future__ import annotations

import torch

from qcompiler.artifact.request import OpenedArtifact
from qcompiler.errors import QcError, UsageError
from qcompiler.ir.module_attrs import model_dtype
from qcompiler.runtime.kernels import SM80_LIMITS, DeviceLimits, Place


class LoadError(QcError):
    """The artifact cannot be loaded under the asked policy (fallback forbidden, no kernel, failed self-check)."""


INTERPRET_SMS = 8
"""SMs the interpreter pretends to have (so the decode kernel splits K on small test shapes)."""


def resolve_place(device: str, opened: OpenedArtifact | None = None) -> Place:
    """``cpu``; ``cuda`` / ``cuda:N`` (a CUDA device torch sees); ``interpret`` (the CUDA kernels on
    Triton's CPU interpreter, host memory)."""
    if device == "cpu":
        return Place()
    if device == "interpret":
        return Place("cuda", torch.device("cpu"), True, 8.0, INTERPRET_SMS, SM80_LIMITS)
    if device != "cuda" and not device.startswith("cuda:"):
        raise UsageError(f"device must be cpu, cuda, cuda:N or interpret, not {device!r}")
    if not torch.cuda.is_available():
        versions = ((opened.manifest if opened else None) or {}).get("versions", {})
        needed = versions.get("required_kernels", []) if isinstance(versions, dict) else []
        raise LoadError(
            f"device {device!r}: torch sees no CUDA device on this machine"
            + (f"; the artifact's {len(needed)} generated kernel(s) need CUDA capability >= 8.0" if needed else "")
            + " (load(device='cpu') runs it on the CPU kernels; device='interpret' runs the CUDA kernels on "
            "Triton's CPU interpreter)"
        )
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    limits = DeviceLimits(
        int(getattr(props, "shared_memory_per_block_optin", 0) or SM80_LIMITS.max_shared_bytes),
        registers_per_sm=int(getattr(props, "regs_per_multiprocessor", 0) or SM80_LIMITS.registers_per_sm),
    )
    return Place("cuda", dev, False, props.major + props.minor / 10, props.multi_processor_count, limits)


COMPUTES = ("auto", "f32", "bf16")


def resolve_compute(compute: str, opened: OpenedArtifact, device: str) -> str:
    """``auto``: ``bf16`` on the CPU when the source model declared bf16 (it was meant to run in bf16), else
    ``f32`` (an f16 model stays exact: bf16 is narrower than f16, and torch has no fast f16 CPU path)."""
    if compute != "auto":
        return compute
    return "bf16" if device == "cpu" and model_dtype(opened.module) == "bf16" else "f32"
