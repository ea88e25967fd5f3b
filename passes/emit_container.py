"""``emit-container``: hand the finished module to the target's backend, which writes the artifact.

The backend writes transactionally (temp directory, fsync, hashes, manifest last, atomic swap),
reopens what it wrote through the production reader, runs parity rungs 1-3 on the reopened
artifact before publishing, and records the evidence in the manifest. The module itself is not
changed except for ``artifact = "<path>"`` naming what was published.

Needs an output directory (``qcompiler compile SOURCE -o OUT --target T``); without one it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.artifact.evidence import ProbeAhead
from qcompiler.backends import get_backend
from qcompiler.errors import PassError
from qcompiler.ir.core import Module
from qcompiler.passes.base import Pass, PassContext, module_target


@dataclass(frozen=True)
class EmitContainerPass(Pass):
    """Write the artifact through the target backend (see the module docstring)."""

    name: ClassVar[str] = "emit-container"
    summary: ClassVar[str] = "write the artifact (transactional), reopen it, record parity"
    requires: ClassVar[frozenset[str]] = frozenset(
        {"semantics-frozen", "axes-canonical", "shards-placed", "layouts-packed", "qdq-fused"}
    )
    target: str = ""
    """backend to emit with (default: the one place-shards planned for)"""
    accuracy_level: int = 1
    """onnx targets: MatMulNBits ``accuracy_level`` (0-4; 1: fp32 compute, 4: int8 activations)"""
    no_cache_graph: bool = False
    """onnx targets, causal LMs: also write the graph without the KV cache (``model_no_cache.onnx``)"""
    attention: str = "decomposed"
    """onnx targets, causal LMs: the decoder graph's attention, ``decomposed`` (plain ops) or ``gqa``
    (``com.microsoft.GroupQueryAttention``, shared past/present buffers in onnxruntime-genai)"""

    def run(self, module: Module, ctx: PassContext) -> Module:
        target = self.target or module_target(module)
        if ctx.artifact is None:
            raise PassError(
                f"emit-container needs an output directory (qcompiler compile SOURCE -o OUT --target {target})"
            )
        backend = get_backend(target)
        ctx.artifact.options = {**ctx.artifact.options, **self.target_options(target, backend.options)}
        ctx.artifact.probe = ProbeAhead(module)  # the graph probe runs while the files are written
        path = backend.emit(module, ctx.artifact)
        module.attrs["artifact"] = str(path)
        ctx.count("emit-container.artifacts")
        return module

    def target_options(self, target: str, takes: frozenset[str]) -> dict[str, str]:
        """This pass's target options set away from their defaults, as the backend reads them
        (``ArtifactRequest.options``); one the target does not take is a ``PassError``."""
        out: dict[str, str] = {}
        for key, f in self.option_fields().items():
            value = getattr(self, f.name)
            if f.name == "target" or value == f.default:
                continue
            if f.name not in takes:
                raise PassError(f"emit-container: target {target} takes no option {key} (it takes: {sorted(takes)})")
            out[f.name] = str(value)
        if not 0 <= self.accuracy_level <= 4:
            raise PassError(f"emit-container: accuracy-level must be 0-4 (MatMulNBits), found {self.accuracy_level}")
        return out
