"""An HF-style model directory as a compile SOURCE, read as untrusted input.

``load_hf_dir(path)`` runs, in order, and stops at the first refusal with a ``SourceError`` naming the
file and field:

1. ``config.json``: opened under the source path policy, strict JSON (UTF-8, no duplicate keys,
   bounded size and depth), a JSON object whose ``model_type`` transformers knows and is a supported
   family (``families.py``), the fields in
   ``CONFIG_FIELDS`` of the right type and range, no ``quantization_config`` (pre-quantized
   checkpoints are not read yet: transformers would dequantize or need other packages);
2. the checkpoint inventory from the safetensors headers (the reader the safetensors backend declares,
   ``frontend/checkpoint.py``): a
   config without weights, a truncated or malformed shard, an index that disagrees with its shards;
3. transformers builds the config, then the model (its own load report and progress bars
   silenced; any exception it raises on this input becomes a ``SourceError``);
4. the no-random-weights gate (``weights_gate``): the model built on the meta device (no memory)
   against the inventory, before anything loads; after the load, transformers' own
   ``output_loading_info`` too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

from qcompiler.errors import FileError, QcError
from qcompiler.frontend.checkpoint import checkpoint_reader
from qcompiler.frontend.families import family_refusal
from qcompiler.frontend.weights_gate import (
    SourceError,
    check_inventory,
    check_loading_info,
    recognise,
    refuse,
)
from qcompiler.paths import SOURCE, PathError, read_bounded
from qcompiler.quant.experts import unfuse_experts

MAX_CONFIG_BYTES = 16 * 2**20
"""The module that reads a directory's checkpoint inventory (the safetensors format's source reader)."""
POSITIVE_INTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
)
NUMBERS = ("rms_norm_eps", "layer_norm_eps", "rope_theta", "initializer_range")
MAX_DIM = 1 << 24
"""Largest hidden size, head count or vocabulary a config may declare (before any allocation)."""


def config_error(path: Path, message: str, field: str = "", expected: object = "", found: object = "") -> SourceError:
    return SourceError(message, file=str(path / "config.json"), field=field, expected=expected, found=found)


def read_config(path: Path, quantized: bool = False) -> dict[str, Any]:
    """``config.json`` checked as step 1 of the module docstring says (``quantized``: for a reader of
    pre-quantized checkpoints, which takes the ``quantization_config`` the float path refuses)."""
    from qcompiler.artifact.reader import parse_json

    try:
        config = parse_json(read_bounded(path, "config.json", MAX_CONFIG_BYTES, SOURCE), "config.json")
    except PathError as e:
        raise config_error(path, e.message, e.field, e.expected, e.found) from None
    except FileError as e:
        raise config_error(path, e.message, e.field, e.expected, e.found) from None
    if not isinstance(config, dict):
        raise config_error(path, "must be a JSON object", expected="{...}", found=type(config).__name__)
    check_fields(path, config, quantized)
    return config


QUANT_CONFIG_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
"""An older GPTQ/AWQ repository's own config file (no ``quantization_config`` in config.json) -> method."""


def quant_method(path: Path) -> str | None:
    """The quantization method of a pre-quantized HF directory (``quantization_config.quant_method``,
    or the method of an older repository's own config file), ``None`` for a float checkpoint."""
    config = read_config(path, quantized=True)
    qc = config.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if not isinstance(method, str):
            raise config_error(path, "must name its method", "quantization_config.quant_method", "a string", method)
        return method
    return next((m for f, m in QUANT_CONFIG_FILES.items() if (path / f).is_file()), None)


def check_fields(path: Path, config: dict[str, Any], quantized: bool = False) -> None:
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise config_error(
            path, "unknown model_type (transformers has no such architecture)", "model_type", "a known type", model_type
        )
    archs = config.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise config_error(path, "must be a list of class names", "architectures", "[str, ...]", archs)
    why = family_refusal(model_type, archs)
    if why:
        raise config_error(path, why, "model_type", "a supported family", model_type)
    for key in POSITIVE_INTS:
        value = config.get(key)
        if value is not None and (type(value) is not int or not 0 < value <= MAX_DIM):
            raise config_error(path, "must be a positive integer", key, f"1..{MAX_DIM}", repr(value))
    for key in NUMBERS:
        value = config.get(key)
        if value is not None and (type(value) not in (int, float) or not 0 <= value < float("inf")):
            raise config_error(path, "must be a non-negative number", key, "a number", repr(value))
    qc = config.get("quantization_config")
    if qc is not None and not quantized:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise config_error(
            path,
            "a pre-quantized checkpoint is read by the reader of its format, not as a float model",
            "quantization_config.quant_method",
            "no quantization_config",
            method,
        )


@contextlib.contextmanager
def quiet_transformers() -> Generator[None]:
    """transformers' load report and warnings off while it reads a source (the gate reports instead)."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def guarded(path: Path, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, with any exception transformers raises on this source turned into a ``SourceError``."""
    from qcompiler.env import QC_DEBUG

    try:
        with quiet_transformers():
            return fn()
    except QcError:
        raise
    except Exception as e:
        if QC_DEBUG.level() >= 1:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise SourceError(f"transformers cannot {what}: {type(e).__name__}: {first}", file=str(path)) from None


def check_source(path: Path) -> tuple[Any, Any, dict[str, str]]:
    """Steps 1, 2 and the first half of 4 (see the module docstring): the transformers auto class
    and config of ``path``, every tensor its checkpoint declares matched against the model built on
    the meta device (and the tensors it may drop, for transformers' own load report). Nothing heavy
    has run when this returns."""
    import transformers

    from qcompiler.frontend.source_info import tied_aliases

    if not (path / "config.json").is_file():
        raise SourceError("no config.json, so this is not an HF-style model directory", file=str(path))
    config = read_config(path)
    source = checkpoint_reader()
    try:
        inventory = source.checkpoint_inventory(path)
    except FileError as e:
        where = str(path / e.file) if not Path(e.file).is_absolute() else e.file
        raise SourceError(
            e.message, file=where, tensor=e.tensor, field=e.field, expected=e.expected, found=e.found
        ) from None
    arch = str((config.get("architectures") or [""])[0])
    auto = transformers.AutoModelForCausalLM if causal_lm(arch) else transformers.AutoModel

    def read_config_obj() -> Any:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)

    cfg = guarded(path, "read config.json", read_config_obj)

    def skeleton() -> Any:
        with torch.device("meta"):
            return unfuse_experts(auto.from_config(cfg, dtype=torch.float32))

    declared = {name: (d.dtype, d.shape) for name, d in inventory.items()}

    def same_bytes(a: str, b: str) -> bool:
        return source.read_declared(path, inventory[a], a) == source.read_declared(path, inventory[b], b)

    empty = guarded(path, "build this model from config.json", skeleton)
    findings = check_inventory(empty, declared, tied_aliases(empty), same_bytes)
    if not findings.ok():
        raise refuse(str(path), findings, recognise(declared, [p.name for p in path.iterdir()]))
    return auto, cfg, dict(findings.dropped)


def causal_lm(arch: str) -> bool:
    """Whether config.json's architecture is a causal LM (``*ForCausalLM``, or one transformers maps
    under another name: ``GPT2LMHeadModel``), built with its output head rather than the bare model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return arch.endswith("ForCausalLM") or arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def load_hf_dir(path: Path) -> Any:
    """A transformers model loaded from ``path``, every weight proven to come from its checkpoint
    (see the module docstring); returns the loaded ``PreTrainedModel`` in float32."""
    auto, cfg, dropped = check_source(path)

    def load() -> Any:
        return auto.from_pretrained(
            path, config=cfg, local_files_only=True, dtype=torch.float32, output_loading_info=True
        )

    model, info = guarded(path, "build and load this model", load)
    check_loading_info(str(path), info, dropped)
    return unfuse_experts(model).eval()
