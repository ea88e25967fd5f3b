"""compressed-tensors ``quantization_config``: written from the module's descriptors, read back strictly.

Written (one config group per distinct weight scheme; ``format`` at both levels because some
consumers read only one)::

    {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
        "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                    "group_size": 32, "dynamic": false, "actorder": null},
        "input_activations": null, "output_activations": null}},
     "ignore": ["lm_head"], "kv_cache_scheme": null, "sparsity_config": {}, "transform_config": {}}

``quantization_status`` must be ``compressed``: without it transformers loads the checkpoint with
random weights and no error. ``ignore`` names every Linear kept dense, since ``targets: ["Linear"]``
would otherwise claim it. The reader accepts only what this backend can check: integer, static,
channel or group strategies, 2-8 bits, keys known to compressed-tensors (which forbids unknown ones).

FP8 weights (family ``f8e4m3``) are written as ``float-quantized`` groups (``"type": "float"``,
8 bits, symmetric; ``tensor``, ``channel`` or ``group`` strategy), the top-level ``format`` saying
``float-quantized`` (``mixed-precision`` beside integer groups). A source's dynamic FP8 activation
scheme (``input_activations`` of llmcompressor's ``FP8_DYNAMIC``) is recorded in the module's
provenance and written back in the group of the modules that declared it; the graph itself computes
activations in float. Static activation scales (``input_scale`` tensors) are refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from qcompiler.ir.types import QuantType

FORMAT = "pack-quantized"
FLOAT_FORMAT = "float-quantized"
ACTIVATION_KEYS = frozenset(
    {
        "num_bits",
        "type",
        "symmetric",
        "strategy",
        "dynamic",
        "group_size",
        "observer",
        "observer_kwargs",
        "block_structure",
        "actorder",
        "scale_dtype",
        "zp_dtype",
    }
)
"""Keys of a dynamic FP8 activation scheme (``input_activations``), which is recorded and re-emitted."""
WEIGHT_KEYS = frozenset(
    {
        "num_bits",
        "type",
        "symmetric",
        "strategy",
        "group_size",
        "block_structure",
        "dynamic",
        "actorder",
        "scale_dtype",
        "zp_dtype",
        "observer",
        "observer_kwargs",
    }
)
GROUP_KEYS = frozenset({"targets", "weights", "input_activations", "output_activations", "format"})


class ConfigError(ValueError):
    """A ``quantization_config`` entry this backend does not accept; ``field`` names the JSON path."""

    def __init__(self, field: str, message: str, expected: str = "", found: object = "") -> None:
        self.field, self.message, self.expected, self.found = field, message, expected, found
        tail = f" (expected {expected}, found {found!r})" if expected else ""
        super().__init__(f"{field}: {message}{tail}")


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight arguments, as this backend understands them (``type`` ``float``:
    FP8 E4M3 weights, ``float-quantized``)."""

    num_bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    type: str = "int"

    @property
    def format(self) -> str:
        return FLOAT_FORMAT if self.type == "float" else FORMAT

    def args(self) -> dict[str, Any]:
        return {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "strategy": self.strategy,
            "group_size": self.group_size,
            "dynamic": False,
            "actorder": None,
        }


def scheme_of(t: QuantType) -> WeightScheme:
    kind = "float" if t.family == "f8e4m3" else "int"
    if t.group is None:  # one scale for the tensor (FP8 ``tensor`` strategy)
        return WeightScheme(t.code.dtype.bits, True, "tensor", None, kind)
    channel = t.group.size == int(t.shape[1])
    return WeightScheme(
        t.code.dtype.bits,
        t.qparam("zero") is None,
        "channel" if channel else "group",
        None if channel else t.group.size,
        kind,
    )


def uniform_schemes(weights: dict[str, QuantType]) -> dict[str, WeightScheme]:
    """Each module's scheme, a layer whose one group spans its whole row written as a group of that
    size when every grouped layer uses that size (a w4-g128 model whose 128-wide layers would
    otherwise read ``channel``): one config group, which transformers' dequantizing load needs
    (it applies the first group's arguments to every module)."""
    schemes = {n: scheme_of(t) for n, t in weights.items()}
    sizes = {s.group_size for s in schemes.values() if s.strategy == "group"}
    if len(sizes) != 1:
        return schemes
    size = next(iter(sizes))
    return {
        n: WeightScheme(s.num_bits, s.symmetric, "group", size, s.type)
        if s.strategy == "channel" and int(weights[n].shape[1]) == size
        else s
        for n, s in schemes.items()
    }


def build(
    weights: dict[str, QuantType], dense_linears: list[str], activations: dict[str, str] | None = None
) -> dict[str, Any]:
    """The config for quantized Linear modules ``{module name: type}`` and the Linears kept dense;
    ``activations``: module -> the canonical JSON of the dynamic activation scheme its source
    declared (``input_activations``, FP8 W8A8), written back as it was."""
    acts = activations or {}
    by_module = {n: (s, acts.get(n, "")) for n, s in uniform_schemes(weights).items()}
    schemes = sorted(
        set(by_module.values()),
        key=lambda k: (k[0].type, k[0].num_bits, k[0].strategy, k[0].group_size or 0, k[0].symmetric, k[1]),
    )
    groups: dict[str, Any] = {}
    for i, key in enumerate(schemes):
        s, act = key
        targets = ["Linear"] if len(schemes) == 1 else sorted(n for n, sc in by_module.items() if sc == key)
        groups[f"group_{i}"] = {
            "targets": targets,
            "format": s.format,
            "weights": s.args(),
            "input_activations": json.loads(act) if act else None,
            "output_activations": None,
        }
    formats = {s.format for s, _ in schemes} or {FORMAT}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(dense_linears),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
    }


@dataclass(frozen=True)
class Group:
    name: str
    targets: tuple[str, ...]
    scheme: WeightScheme
    format: str = FORMAT
    activations: str = ""
    """The canonical JSON of a dynamic FP8 ``input_activations`` scheme, or ``""`` (weight-only)."""


@dataclass(frozen=True)
class ParsedConfig:
    groups: tuple[Group, ...]
    ignore: tuple[str, ...]

    def scheme_for(self, module: str, is_linear: bool) -> WeightScheme | None:
        """The scheme compressed-tensors applies to ``module`` (first matching group), or ``None``."""
        g = self.group_for(module, is_linear)
        return None if g is None else g.scheme

    def group_for(self, module: str, is_linear: bool) -> Group | None:
        if any(matches(p, module, is_linear) for p in self.ignore):
            return None
        for g in self.groups:
            if any(matches(p, module, is_linear) for p in g.targets):
                return g
        return None


def matches(pattern: str, module: str, is_linear: bool) -> bool:
    """compressed-tensors target syntax: a class name (``Linear``), ``re:<regex>``, or an exact name."""
    if pattern == "Linear":
        return is_linear
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def expect(cond: bool, field: str, message: str, expected: str = "", found: object = "") -> None:
    if not cond:
        raise ConfigError(field, message, expected, found)


def parse(qc: object, formats: tuple[str, ...] = (FORMAT, FLOAT_FORMAT)) -> ParsedConfig:
    """Check a ``quantization_config`` strictly; ``ConfigError`` names the offending JSON path.
    ``formats``: the weight formats accepted (a source reads more than this backend writes)."""
    f = "quantization_config"
    expect(isinstance(qc, dict), f, "must be an object", "an object", type(qc).__name__)
    assert isinstance(qc, dict)
    expect(
        qc.get("quant_method") == "compressed-tensors",
        f"{f}.quant_method",
        "unsupported",
        '"compressed-tensors"',
        qc.get("quant_method"),
    )
    top = qc.get("format")
    tops = (*formats, "mixed-precision")
    expect(top in tops, f"{f}.format", "unsupported top-level format", " or ".join(tops), top)
    expect(
        qc.get("quantization_status") == "compressed",
        f"{f}.quantization_status",
        "must say the weights are compressed (otherwise transformers loads random weights silently)",
        '"compressed"',
        qc.get("quantization_status"),
    )
    raw_groups = qc.get("config_groups")
    expect(
        isinstance(raw_groups, dict) and bool(raw_groups),
        f"{f}.config_groups",
        "must be a non-empty object",
        "an object",
        raw_groups,
    )
    assert isinstance(raw_groups, dict)
    ignore = qc.get("ignore") or []
    expect(
        isinstance(ignore, list) and all(isinstance(i, str) for i in ignore),
        f"{f}.ignore",
        "must be a list of names",
        "[str, ...]",
        ignore,
    )
    fmt = str(top) if top in formats else formats[0]
    groups = tuple(parse_group(f"{f}.config_groups.{name}", name, g, fmt, formats) for name, g in raw_groups.items())
    return ParsedConfig(groups, tuple(ignore))


def parse_group(f: str, name: str, g: object, top: str = FORMAT, formats: tuple[str, ...] = (FORMAT,)) -> Group:
    expect(isinstance(g, dict), f, "must be an object", "an object", type(g).__name__)
    assert isinstance(g, dict)
    unknown = sorted(set(g) - GROUP_KEYS)
    expect(not unknown, f, "unknown keys (compressed-tensors forbids them)", ", ".join(sorted(GROUP_KEYS)), unknown)
    fmt = g.get("format") or top
    expect(fmt in formats, f"{f}.format", "unsupported group format", " or ".join(formats), fmt)
    targets = g.get("targets")
    expect(
        isinstance(targets, list) and bool(targets) and all(isinstance(t, str) for t in targets),
        f"{f}.targets",
        "must be a non-empty list of names",
        "[str, ...]",
        targets,
    )
    assert isinstance(targets, list)
    expect(
        g.get("output_activations") is None,
        f"{f}.output_activations",
        "output activation quantization is not read",
        "null",
        g.get("output_activations"),
    )
    activations = parse_activations(f"{f}.input_activations", g.get("input_activations"), fmt)
    w = g.get("weights")
    expect(isinstance(w, dict), f"{f}.weights", "must be an object", "an object", w)
    assert isinstance(w, dict)
    wf = f"{f}.weights"
    unknown = sorted(set(w) - WEIGHT_KEYS)
    expect(not unknown, wf, "unknown keys (compressed-tensors forbids them)", "known QuantizationArgs keys", unknown)
    bits = w.get("num_bits", 8)
    expect(
        isinstance(bits, int) and not isinstance(bits, bool) and 2 <= bits <= 8,
        f"{wf}.num_bits",
        "out of range",
        "2..8",
        bits,
    )
    kind = "float" if fmt == FLOAT_FORMAT else "int"
    expect(w.get("type", "int") == kind, f"{wf}.type", f"unsupported for format {fmt}", repr(kind), w.get("type"))
    expect(kind == "int" or bits == 8, f"{wf}.num_bits", "float-quantized weights are FP8", "8", bits)
    expect(w.get("dynamic", False) is False, f"{wf}.dynamic", "weights must be static", "false", w.get("dynamic"))
    expect(
        w.get("block_structure") is None,
        f"{wf}.block_structure",
        "block strategy is not supported",
        "null",
        w.get("block_structure"),
    )
    sym = w.get("symmetric", True)
    expect(isinstance(sym, bool), f"{wf}.symmetric", "must be a boolean", "true or false", sym)
    strategy, gs = w.get("strategy"), w.get("group_size")
    strategies = ("channel", "group", "tensor") if kind == "float" else ("channel", "group")
    expect(strategy in strategies, f"{wf}.strategy", "unsupported", " or ".join(map(repr, strategies)), strategy)
    expect(kind == "int" or sym is True, f"{wf}.symmetric", "FP8 weights are symmetric", "true", sym)
    if strategy == "group":
        expect(
            isinstance(gs, int) and not isinstance(gs, bool) and gs > 0,
            f"{wf}.group_size",
            "group strategy needs a positive group size",
            "> 0",
            gs,
        )
    else:
        expect(gs in (None, -1), f"{wf}.group_size", "channel strategy takes no group size", "null or -1", gs)
    assert isinstance(bits, int)
    assert isinstance(sym, bool)
    scheme = WeightScheme(bits, sym, str(strategy), gs if strategy == "group" else None, kind)
    return Group(name, tuple(targets), scheme, str(fmt), activations)


def parse_activations(f: str, a: object, fmt: str) -> str:
    """A group's ``input_activations``: ``null``, or (``float-quantized`` only) a dynamic FP8 scheme,
    which needs no stored tensor; returned as canonical JSON. Static activation scales (an
    ``input_scale`` per layer) and integer activations are refused by field."""
    if a is None:
        return ""
    expect(fmt == FLOAT_FORMAT, f, "activation quantization is read only with FP8 weights", "null", a)
    expect(isinstance(a, dict), f, "must be an object", "an object", type(a).__name__)
    assert isinstance(a, dict)
    unknown = sorted(set(a) - ACTIVATION_KEYS)
    expect(not unknown, f, "unknown keys (compressed-tensors forbids them)", "known QuantizationArgs keys", unknown)
    expect(
        a.get("type") == "float" and a.get("num_bits") == 8,
        f"{f}.type",
        "only FP8 activations",
        "float, 8 bits",
        a.get("type"),
    )
    expect(
        a.get("dynamic") is True,
        f"{f}.dynamic",
        "static activation scales (input_scale tensors) are not read; only dynamic FP8 activations",
        "true",
        a.get("dynamic"),
    )
    expect(
        a.get("strategy") in ("token", "tensor"),
        f"{f}.strategy",
        "unsupported",
        "'token' or 'tensor'",
        a.get("strategy"),
    )
    return json.dumps(a, sort_keys=True, separators=(",", ":"))


CONV1D_MODEL_TYPES = ("gpt2", "openai-gpt")
"""transformers model types whose projections are ``Conv1D`` (weight stored ``[K, N]``, in x out)."""


def conv1d_refusal(config: dict[str, Any], scheme: str) -> str:
    """Why a model of transformers config ``config`` quantized with ``scheme`` has no compressed-tensors
    checkpoint ("" when it has one). compressed-tensors groups a weight's qparams along the last dim
    of the tensor the module stores (``initialize_qparams``: ``(*shape[:-1], ceil(shape[-1] / G))``)
    and matches modules by class (``targets: ["Linear"]``): a ``Conv1D`` stores ``[K, N]``, so its
    groups would run along the output features, and nothing there transposes it back. The codes,
    quantized along the input features as a Linear's, cannot be written as such a checkpoint."""
    model_type = config.get("model_type")
    if model_type not in CONV1D_MODEL_TYPES:
        return ""
    return (
        f"target safetensors: a {model_type} model quantized with --scheme {scheme} has no compressed-tensors "
        "checkpoint: its projections are transformers Conv1D modules (weight stored [K, N]), whose "
        "quantization compressed-tensors cannot state (it groups along a stored weight's last dim, the "
        "output features here, and targets Linear modules); compile it without --scheme for a float "
        "checkpoint, or quantized to the gguf, onnx-nbits or triton target"
    )
