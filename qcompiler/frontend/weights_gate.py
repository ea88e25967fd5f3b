"""The no-random-weights gate: a model built from a source is used only if every tensor it needs came
from the source, and every tensor the source declares went somewhere.

transformers builds the model from ``config.json`` and fills it from the checkpoint; a parameter the
checkpoint lacks is initialised randomly and a tensor it does not know is dropped, each with a
warning at most. An older GPTQ repository (``qweight/qzeros/scales/g_idx``, no ``quantization_config``)
loads that way as a *random* model. This gate refuses it, before and after transformers loads:

1. ``check_inventory(model, declared, ...)`` compares the checkpoint's own inventory (read from its
   safetensors headers) with the model's checkpoint keys (parameters once each, persistent buffers):

   | finding | verdict |
   |---|---|
   | a model key no source tensor fills | missing: ``SourceError`` |
   | a source tensor no model key takes | unexpected: ``SourceError``, unless ``IGNORED`` declares it |
   | a shape that differs, or an integer tensor for a float parameter | mismatched: ``SourceError`` |
   | a tied alias stored too (``lm_head.weight`` under ``tie_word_embeddings``) | must equal its twin byte for byte |

   Names are matched as transformers matches them (with or without ``base_model_prefix``).
2. ``check_loading_info(info, ...)`` requires transformers' own ``output_loading_info`` lists to be
   empty (but for ``IGNORED`` names): the second opinion, for what the first cannot see.

Every refusal names the source, the first keys of each kind and their counts, and says what the
source looks like when it is recognisable (a GPTQ/AWQ checkpoint).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from qcompiler.errors import FileError

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
GPTQ_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
SHOWN = 3
"""Keys of each kind a message lists before it counts the rest."""


class SourceError(FileError):
    """A source cannot be used as it is: a weight would be missing, dropped, reshaped or invented."""


@dataclass(frozen=True)
class Ignored:
    """A source tensor that transformers deliberately does not load, and why that loses nothing."""

    pattern: str
    reason: str


IGNORED: tuple[Ignored, ...] = (
    Ignored(r"(^|\.)embeddings\.position_ids$", "an index buffer transformers rebuilds (arange), not a weight"),
    Ignored(r"(^|\.)rotary_emb\.inv_freq$", "rotary frequencies transformers recomputes from rope_theta"),
    Ignored(r"(^|\.)attn\.masked_bias$|(^|\.)attn\.bias$", "a causal-mask buffer older GPT-2 checkpoints saved"),
)
"""Source tensors consumed by being rebuilt; any other tensor the model does not take is an error."""


def ignored(name: str) -> Ignored | None:
    return next((i for i in IGNORED if re.search(i.pattern, name)), None)


@dataclass
class Findings:
    """What ``check_inventory`` found, by kind (empty when the source fills the model exactly)."""

    missing: list[str] = field(default_factory=list[str])
    unexpected: list[str] = field(default_factory=list[str])
    mismatched: list[str] = field(default_factory=list[str])
    dropped: dict[str, str] = field(default_factory=dict[str, str])
    """Ignored source tensor -> the reason (recorded, not an error)."""

    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def model_keys(model: nn.Module) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The model's checkpoint keys -> (shape, is float): each parameter once (tied ones under their
    first name) and every persistent buffer."""
    out = {name: (tuple(p.shape), p.is_floating_point()) for name, p in model.named_parameters()}
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{b_name}" if mod_name else b_name] = (tuple(b.shape), b.is_floating_point())
    return out


def matcher(model: nn.Module, keys: Mapping[str, object]) -> Callable[[str], str | None]:
    """Source tensor name -> the model key it fills, as transformers matches them (a checkpoint saved
    from the base model lacks ``base_model_prefix.``; one saved from a head model has it)."""
    prefix = str(getattr(model, "base_model_prefix", "") or "")

    def match(name: str) -> str | None:
        if name in keys:
            return name
        if prefix and f"{prefix}.{name}" in keys:
            return f"{prefix}.{name}"
        if prefix and name.startswith(f"{prefix}.") and name[len(prefix) + 1 :] in keys:
            return name[len(prefix) + 1 :]
        return None

    return match


def check_inventory(
    model: nn.Module,
    declared: Mapping[str, tuple[str, Sequence[int]]],
    aliases: Mapping[str, str],
    same_bytes: Callable[[str, str], bool],
) -> Findings:
    """Compare the source's tensors (name -> (dtype, shape)) with ``model``'s keys (see the module
    docstring). ``aliases``: tied name -> the name the checkpoint keeps; ``same_bytes(a, b)`` reads two
    source tensors and says whether their bytes are equal."""
    keys = model_keys(model)
    match = matcher(model, keys)
    found = Findings()
    filled: set[str] = set()
    for name, (dtype, shape) in sorted(declared.items()):
        key = match(name)
        if key is None:
            twin = aliases.get(name) or aliases.get(name.removeprefix(f"{model.base_model_prefix}."))
            if twin is not None and twin in declared:
                if not same_bytes(name, twin):
                    found.mismatched.append(f"{name} (tied to {twin} by the config, but its bytes differ)")
                continue
            why = ignored(name)
            if why is None:
                found.unexpected.append(name)
            else:
                found.dropped[name] = why.reason
            continue
        want, is_float = keys[key]
        if tuple(shape) != want:
            found.mismatched.append(f"{name} (shape {list(shape)}, the model needs {list(want)})")
        elif is_float and dtype not in FLOAT_DTYPES:
            found.mismatched.append(f"{name} ({dtype}, the model needs a float tensor)")
        filled.add(key)
    found.missing = sorted(set(keys) - filled)
    return found


def refuse(source: str, findings: Findings, hint: str = "") -> SourceError:
    """The error for ``findings`` (``findings.ok()`` is false)."""
    parts: list[str] = []
    for kind, names in (
        ("missing from the source (would be initialised randomly)", findings.missing),
        ("in the source but not taken by the model (would be dropped)", findings.unexpected),
        ("mismatched", findings.mismatched),
    ):
        if names:
            more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            parts.append(f"{len(names)} {kind}: {', '.join(names[:SHOWN])}{more}")
    message = "the model built from this source would not hold the source's weights; " + "; ".join(parts)
    if hint:
        message += f". {hint}"
    return SourceError(message, file=source, field="tensors")


def recognise(declared: Mapping[str, object], files: Sequence[str]) -> str:
    """A hint naming what the source looks like, when it is a known quantized checkpoint format."""
    if any(n.endswith(GPTQ_SUFFIXES) for n in declared) or "quantize_config.json" in files:
        return (
            "It looks like a GPTQ/AWQ checkpoint (qweight/qzeros/scales tensors) whose method is not named: "
            "its codes would be replaced by random weights, so it is refused; add the quantization_config "
            "(quant_method, bits, group_size) it was made with to config.json, or its quantize_config.json"
        )
    return ""


def check_loading_info(source: str, info: Mapping[str, Any], dropped: Mapping[str, str]) -> None:
    """transformers' own ``output_loading_info``: nothing missing, unexpected or mismatched but the
    tensors this gate already declared dropped."""
    findings = Findings(
        missing=sorted(str(k) for k in info.get("missing_keys", ()) or ()),
        unexpected=sorted(str(k) for k in info.get("unexpected_keys", ()) or () if str(k) not in dropped),
        mismatched=sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ()) or ()),
    )
    if not findings.ok():
        raise refuse(source, findings, "transformers reported it while loading")
