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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from qcompiler.ir.types import QuantType

FORMAT = "pack-quantized"
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
    """One config group's weight arguments, as this backend understands them."""

    num_bits: int
    symmetric: bool
    strategy: str
    group_size: int | None

    def args(self) -> dict[str, Any]:
        return {
            "num_bits": self.num_bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": self.strategy,
            "group_size": self.group_size,
            "dynamic": False,
            "actorder": None,
        }


def scheme_of(t: QuantType) -> WeightScheme:
    assert t.group is not None
    channel = t.group.size == int(t.shape[1])
    return WeightScheme(
        t.code.dtype.bits,
        t.qparam("zero") is None,
        "channel" if channel else "group",
        None if channel else t.group.size,
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
        n: WeightScheme(s.num_bits, s.symmetric, "group", size)
        if s.strategy == "channel" and int(weights[n].shape[1]) == size
        else s
        for n, s in schemes.items()
    }


def build(weights: dict[str, QuantType], dense_linears: list[str]) -> dict[str, Any]:
    """The config for quantized Linear modules ``{module name: type}`` and the Linears kept dense."""
    by_module = uniform_schemes(weights)
    schemes = sorted(set(by_module.values()), key=lambda s: (s.num_bits, s.strategy, s.group_size or 0, s.symmetric))
    groups: dict[str, Any] = {}
    for i, s in enumerate(schemes):
        targets = ["Linear"] if len(schemes) == 1 else sorted(n for n, sc in by_module.items() if sc == s)
        groups[f"group_{i}"] = {
            "targets": targets,
            "format": FORMAT,
            "weights": s.args(),
            "input_activations": None,
            "output_activations": None,
        }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
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


def parse(qc: object, formats: tuple[str, ...] = (FORMAT,)) -> ParsedConfig:
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
    tops = formats if formats == (FORMAT,) else (*formats, "mixed-precision")
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
    for key in ("input_activations", "output_activations"):
        expect(
            g.get(key) is None,
            f"{f}.{key}",
            "activation quantization is not a weight-only pack-quantized scheme",
            "null",
            g.get(key),
        )
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
    expect(w.get("type", "int") == "int", f"{wf}.type", "unsupported", '"int"', w.get("type"))
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
    expect(strategy in ("channel", "group"), f"{wf}.strategy", "unsupported", '"channel" or "group"', strategy)
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
    scheme = WeightScheme(bits, sym, str(strategy), gs if strategy == "group" else None)
    return Group(name, tuple(targets), scheme, str(fmt))
