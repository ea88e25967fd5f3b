"""Pass registry: a lazy ``name -> "module:Class"`` table, plus plugins from the
``qcompiler.passes`` entry-point group. Import cost is paid only for the passes a pipeline names.

The default pipeline, one step per line with why it sits there:

1. ``freeze-semantics``  — turn the source's quantization state into immutable descriptors first;
   everything later may assume codes never change.
2. ``canonicalize-axes`` — one [N, K] orientation with groups along K, so later passes see one shape.
3. ``place-shards``      — file shards and parallel placement; packing needs per-shard shapes.
4. ``pack-layouts``      — choose physical layouts for the target, proving unpack(pack(Q)) == Q.
5. ``fuse-qdq``          — fold dequantize->op into quantized ops (or materialise QDQ) on final layouts.
6. ``emit-container``    — hand the module to the target backend.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from qcompiler.errors import PipelineError
from qcompiler.passes.base import Pass

PASSES: dict[str, str] = {
    "freeze-semantics": "qcompiler.passes.freeze_semantics:FreezeSemanticsPass",
    "canonicalize-axes": "qcompiler.passes.canonicalize_axes:CanonicalizeAxesPass",
    "place-shards": "qcompiler.passes.place_shards:PlaceShardsPass",
    "pack-layouts": "qcompiler.passes.pack_layouts:PackLayoutsPass",
    "fuse-qdq": "qcompiler.passes.fuse_qdq:FuseQdqPass",
    "emit-container": "qcompiler.passes.emit_container:EmitContainerPass",
    "dce": "qcompiler.passes.dce:DcePass",
    "cse": "qcompiler.passes.cse:CsePass",
}

DEFAULT_PIPELINE = "freeze-semantics,canonicalize-axes,place-shards,pack-layouts,fuse-qdq,emit-container"

_plugins_loaded = False


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group="qcompiler.passes"):
        if ep.name in PASSES:
            raise PipelineError(
                f"plugin pass '{ep.name}' ({ep.value}) clashes with an existing pass ({PASSES[ep.name]})"
            )
        PASSES[ep.name] = ep.value


def pass_names() -> list[str]:
    _load_plugins()
    return list(PASSES)


def get_pass_class(name: str) -> type[Pass] | None:
    """The pass class registered as ``name`` (imported on first use), or ``None``."""
    _load_plugins()
    target = PASSES.get(name)
    if target is None:
        return None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Pass)) or cls.name != name:
        raise PipelineError(f"registry entry '{name}' -> {target} is not a Pass named '{name}'")
    return cls


__all__ = ["DEFAULT_PIPELINE", "PASSES", "Pass", "get_pass_class", "pass_names"]
