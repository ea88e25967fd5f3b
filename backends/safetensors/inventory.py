"""The checkpoint inventory an architecture implies, from its config.json alone.

The transformers class named by ``architectures[0]`` is instantiated on the ``meta`` device (no
memory for weights), and its parameters (tied ones once) and persistent buffers give the exact
names and shapes a checkpoint must hold; its ``nn.Linear`` modules are what compressed-tensors'
``targets: ["Linear"]`` matches. The writer and the reader both check against this.

``CONFIG_FACTS`` then checks config.json by meaning: each hyperparameter transformers reads that the
graph also shows (``qcompiler.ir.facts``) must equal the graph's, so a re-hashed edit of
``rms_norm_eps`` or ``rope_theta`` is refused by name.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from qcompiler.artifact.reader import ArtifactError
from qcompiler.ir.core import Module
from qcompiler.ir.facts import ModelFacts, model_facts, rope_matches
from qcompiler.quant.experts import unfuse_experts


class InventoryError(ValueError):
    """The config names no architecture transformers can build; ``field`` is the config key at fault."""

    def __init__(self, message: str, field: str = "architectures") -> None:
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class Inventory:
    architecture: str
    tensors: Mapping[str, tuple[tuple[int, ...], str]]
    """Checkpoint tensor name -> (shape, torch dtype name) for a dense checkpoint (read-only: shared)."""
    linears: frozenset[str]
    """Qualified names of every ``nn.Linear`` module."""


LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_encoder_layers", "num_decoder_layers")
"""Config keys that multiply the number of modules built; bounded before anything is instantiated."""

BUILT: dict[str, Inventory] = {}
"""Canonical config.json text -> its inventory: a compile's writer and its reopen ask for the same
config's (building a 1.1B Llama on meta: about 0.3 s each). At most ``MAX_BUILT`` are kept."""
MAX_BUILT = 8
_BUILT_LOCK = threading.Lock()


def architecture_inventory(config: dict[str, Any], max_layers: int = 4096) -> Inventory:
    """Build the architecture on the meta device. ``max_layers`` bounds every layer count first (an
    untrusted config could otherwise ask for a billion modules); the reader passes the number of
    tensors the checkpoint actually holds. The same config's inventory is built once (``BUILT``)."""
    for key in LAYER_KEYS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= max_layers):
            raise InventoryError(f"must be an integer in 1..{max_layers} (found {value!r})", key)
    try:
        text = json.dumps(config, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):  # not JSON: built every time
        text = ""
    with _BUILT_LOCK:
        known = BUILT.get(text) if text else None
    if known is not None:
        return known
    inv = built(config)
    if text:
        with _BUILT_LOCK:
            if len(BUILT) >= MAX_BUILT:
                BUILT.clear()
            BUILT[text] = inv
    return inv


def built(config: dict[str, Any]) -> Inventory:
    """``architecture_inventory`` of a config whose layer counts were bounded."""
    import transformers

    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    cls = getattr(transformers, arch, None) if arch else None
    if not isinstance(cls, type):
        raise InventoryError(f"architectures names no transformers model class (found {archs!r})")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise InventoryError(f"must be a string (found {model_type!r})", "model_type")
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
            with torch.device("meta"):
                model: nn.Module = unfuse_experts(cls(cfg))  # MoE experts as their checkpoint names them
    except Exception as e:  # a config transformers cannot build is untrusted input, not a crash
        raise InventoryError(f"transformers cannot build {arch} from this config: {type(e).__name__}: {e}") from None
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, p in model.named_parameters():
        tensors[name] = (tuple(p.shape), str(p.dtype).removeprefix("torch."))
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                tensors[f"{mod_name}.{b_name}" if mod_name else b_name] = (
                    tuple(b.shape),
                    str(b.dtype).removeprefix("torch."),
                )
    linears = frozenset(n for n, mod in model.named_modules() if isinstance(mod, nn.Linear))
    return Inventory(arch, MappingProxyType(tensors), linears)


# ---------------------------------------------------------------------------------------------- config facts

ConfigRule = tuple[str, str, str]
"""(config.json key, dotted for a nested one; the graph fact it restates; comparison)."""
CONFIG_FACTS: dict[str, tuple[ConfigRule, ...]] = {
    "llama": (
        ("hidden_size", "hidden", "int"),
        ("num_hidden_layers", "layers", "int"),
        ("num_attention_heads", "heads", "int"),
        ("num_key_value_heads", "kv_heads", "int"),
        ("head_dim", "head_dim", "int"),
        ("intermediate_size", "ff", "int"),
        ("vocab_size", "vocab", "int"),
        ("rms_norm_eps", "eps", "float"),
        ("rope_theta", "inv_freq", "rope"),
        ("rope_parameters.rope_theta", "inv_freq", "rope"),
        ("tie_word_embeddings", "tied", "bool"),
        ("hidden_act", "act", "act"),
    ),
    "bert": (
        ("hidden_size", "hidden", "int"),
        ("num_hidden_layers", "layers", "int"),
        ("num_attention_heads", "heads", "int"),
        ("intermediate_size", "ff", "int"),
        ("vocab_size", "vocab", "int"),
        ("layer_norm_eps", "eps", "float"),
        ("max_position_embeddings", "positions", "int"),
        ("type_vocab_size", "token_types", "int"),
        ("hidden_act", "act", "act"),
    ),
}
"""Per ``model_type``: each hyperparameter transformers reads that the graph also shows. Every other key
(token ids, ``max_position_embeddings`` of a rope model, ``quantization_config`` ...) is bound by the
sha256 record in ``graph.qir``; a model type without a table is bound by that record alone."""
ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
"""transformers ``hidden_act`` -> the graph's activation (``relu`` is itself)."""
DEFAULT_ROPE = (None, "default")


def config_value(config: dict[str, Any], path: str) -> tuple[bool, object]:
    """(present, value) of a dotted key."""
    value: object = config
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]  # pyright: ignore[reportUnknownVariableType]
    return True, value


def agrees(kind: str, facts: ModelFacts, fact: object, value: object) -> bool:
    """Whether a config ``value`` means the graph's ``fact`` under comparison ``kind``."""
    if kind == "int":
        return type(value) is int and value == fact
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool) and float(value) == fact
    if kind == "bool":
        return value is fact
    if kind == "act":
        return isinstance(value, str) and ACTS.get(value, value) == fact
    return isinstance(value, int | float) and not isinstance(value, bool) and rope_matches(facts, float(value))


def check_config_facts(config: dict[str, Any], m: Module) -> None:
    """Gate ``graph`` (binding): each ``CONFIG_FACTS`` key of config.json means what the graph computes."""
    rules = CONFIG_FACTS.get(str(config.get("model_type")), ())
    facts = model_facts(m)
    scaled = config_value(config, "rope_parameters.rope_type")[1] not in DEFAULT_ROPE or config.get("rope_scaling")
    for key, fact_name, kind in rules:
        present, value = config_value(config, key)
        fact = getattr(facts, fact_name)
        if not present or value is None or fact is None or (kind == "rope" and scaled):
            continue
        if not agrees(kind, facts, fact, value):
            shown = f"inv_freq of base {facts.rope_base:.6g}" if kind == "rope" and facts.rope_base else fact
            raise ArtifactError(
                f"disagrees with what graph.qir computes ({fact_name})",
                file="config.json",
                field=key,
                expected=shown,
                found=value,
            )
