"""Mixed 2/4-bit weights (family ``mixprec``) in a safetensors checkpoint: our own schema, not compressed-tensors.

compressed-tensors has no format for a weight whose groups are 2-bit or 4-bit by a precision map,
with second-level scales and CSR outliers. Such weights are stored exactly, in the packed layout the
IR proves (``mixprec`` v1, ``planes-a16``: ``qcompiler.ir.mixprec``), under names of our own, and
``config.json`` says so with a ``quantization_config`` block of our own: transformers and vLLM cannot
load the checkpoint (expected); ``qcompiler``'s reader (``read.py``, ``mixprec_gates.py``) does.

A weight ``X.weight`` (``q.weight {codes, zero, scale = {codes, scale, zero}, wide, wide_rows, rowptr,
col, value}``) of logical shape ``[N, K]``, groups of ``G`` along ``K``, ``R`` all-4-bit rows, ``W``
other 4-bit groups and ``nnz`` outliers:

| container tensor | from (binding slot) | dtype | shape |
|---|---|---|---|
| ``X.weight_planes`` | ``codes`` (layout mixprec v1 planes-a16) | U8 | ``[pad16(N*K/4) + pad16((W+R*K/G)*G/4)]`` |
| ``X.weight_zero`` | ``zero`` (first-level zero points) | U8 | ``[N, K/G]`` |
| ``X.weight_scale_codes`` | ``scale.codes`` (the first-level scales, quantized) | U8 | ``[N, K/G]`` |
| ``X.weight_scale2`` | ``scale.scale`` (second level, along N) | its stored float dtype (F16) | ``[ceil(N/G2), K/G]`` |
| ``X.weight_zero2`` | ``scale.zero`` (second level) | U8 | ``[ceil(N/G2), K/G]`` |
| ``X.weight_scale`` | ``scale`` when it is dense (no second level) | a float | ``[N, K/G]`` |
| ``X.weight_wide`` | ``wide``: flat indices ``r*K/G + g`` of the other 4-bit groups | I16 or I32 | ``[W]`` |
| ``X.weight_wide_rows`` | ``wide_rows``: the rows whose groups are all 4-bit | I16 or I32 | ``[R]`` |
| ``X.weight_rowptr`` | ``rowptr`` (CSR row pointers of the outliers) | I16 (when the outliers fit) or I32 | ``[N+1]`` |
| ``X.weight_col`` | ``col`` | I16 or I32 | ``[nnz]`` |
| ``X.weight_value`` | ``value`` | a float (F16) | ``[nnz]`` |
| ``X.weight_shape`` | the logical shape | I64 | ``[2]`` |

Every tensor is the IR's own bytes (``graph.qir`` locates each one and holds its sha256); the planes
keep the layout's order (4-bit groups in flat group order) and its zero padding, which the reader checks.

``config.json``'s ``quantization_config`` when every quantized weight is ``mixprec`` (a checkpoint that
would mix them with compressed-tensors weights is refused: one config cannot claim both)::

    {"quant_method": "qcompiler-mixprec", "format": "mixprec-planes-a16", "version": 1,
     "group_size": 64, "bits": [2, 4], "outliers": "csr-replacement",
     "targets": ["encoder.layer.0.attention.self.query", ...], "ignore": ["pooler.dense"]}

``targets`` names every mixprec Linear, ``ignore`` every Linear kept dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

from qcompiler.backends.base import ContainerTensor, LayoutPlan, refused
from qcompiler.backends.safetensors.ct_config import ConfigError, expect
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.core import Module, Op
from qcompiler.ir.mixprec import PlanesLayout
from qcompiler.ir.types import PackSpec, QuantType

METHOD = "qcompiler-mixprec"
FORMAT = "mixprec-planes-a16"
VERSION = 1
BITS = [2, 4]
OUTLIERS = "csr-replacement"
PACK = PackSpec("mixprec", 1, "planes-a16", (1, 1))
CHECKPOINT_FORMAT = f"{METHOD} {FORMAT} v{VERSION} (qcompiler's own schema; not compressed-tensors)"

FLOATS = ("BF16", "F16", "F32")
TABLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "weight_planes": ("codes", ("U8",)),
    "weight_zero": ("zero", ("U8",)),
    "weight_scale_codes": ("scale.codes", ("U8",)),
    "weight_scale2": ("scale.scale", FLOATS),
    "weight_zero2": ("scale.zero", ("U8",)),
    "weight_scale": ("scale", FLOATS),
    "weight_wide": ("wide", ("I16", "I32")),
    "weight_wide_rows": ("wide_rows", ("I16", "I32")),
    "weight_rowptr": ("rowptr", ("I16", "I32")),
    "weight_col": ("col", ("I16", "I32")),
    "weight_value": ("value", FLOATS),
    "weight_shape": ("", ("I64",)),
}
"""Container suffix -> (binding slot it stores, ``""`` for the logical shape; container dtypes accepted)."""
SUFFIX = {slot: suffix for suffix, (slot, _) in TABLE.items() if slot}
CONFIG_KEYS = frozenset({"quant_method", "format", "version", "group_size", "bits", "outliers", "targets", "ignore"})


def plan(t: QuantType) -> LayoutPlan:
    """A ``mixprec`` Linear weight is packed exactly into ``planes-a16``."""
    no = refused(
        [
            (t.req == "linear" and t.rank == 2, f"the mixprec schema stores Linear weights only (req={t.req})"),
            (t.perm is None and not t.transforms, "the mixprec schema has no permutation or transform"),
        ]
    )
    return no if no is not None else LayoutPlan("exact", pack=PACK)


@dataclass(frozen=True)
class MixWeight:
    """A ``mixprec`` ``q.weight`` op and its binding, slot path -> tensor-table name."""

    name: str
    op: Op
    t: QuantType
    refs: dict[str, str]

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


def flat(binding: dict[str, AttrValue], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in binding.items():
        if isinstance(v, SymbolRef):
            out[prefix + k] = v.name
        elif isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")  # pyright: ignore[reportUnknownArgumentType]
    return out


def mixprec_weights(m: Module) -> list[MixWeight]:
    out: list[MixWeight] = []
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is not None and t.family == "mixprec":
            refs = flat(op.attrs)
            out.append(MixWeight(refs["codes"].removesuffix(".codes"), op, t, refs))
    return out


def weight_tensors(m: Module, w: MixWeight) -> list[ContainerTensor]:
    """The container tensors of one weight, planes first (it locates the codes), in ``TABLE`` order;
    the planes' size is the packed one whether or not ``pack-layouts`` has run."""
    out: list[ContainerTensor] = []
    for suffix, (slot, _) in TABLE.items():
        name = f"{w.module}.{suffix}"
        if suffix == "weight_planes":
            dtype, shape = PlanesLayout.physical(w.t)
            out.append(ContainerTensor(name, dtype.name, shape, shape[0], (w.refs["codes"],)))
        elif slot in w.refs:
            blob = m.tensors[w.refs[slot]].blob
            out.append(ContainerTensor(name, blob.dtype.name, blob.shape, blob.nbytes, (w.refs[slot],)))
        elif not slot:
            out.append(ContainerTensor(name, "i64", (2,), 16, (w.refs["codes"],)))
    return out


def config_block(weights: list[MixWeight], dense_linears: list[str]) -> dict[str, Any]:
    sizes = sorted({w.t.group.size for w in weights if w.t.group is not None})
    if len(sizes) != 1:
        raise ConfigError("quantization_config.group_size", "one group size for every mixprec weight", "one", sizes)
    return {
        "quant_method": METHOD,
        "format": FORMAT,
        "version": VERSION,
        "group_size": sizes[0],
        "bits": BITS,
        "outliers": OUTLIERS,
        "targets": sorted(w.module for w in weights),
        "ignore": sorted(dense_linears),
    }


@dataclass(frozen=True)
class MixScheme:
    """What the config says of one mixprec Linear (``group_size``: along K)."""

    group_size: int


@dataclass(frozen=True)
class MixConfig:
    scheme: MixScheme
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def scheme_for(self, module: str, is_linear: bool) -> MixScheme | None:
        return self.scheme if module in self.targets and module not in self.ignore else None


def is_mixprec(qc: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(qc, dict) and qc.get("quant_method") == METHOD  # pyright: ignore[reportUnknownMemberType]


def parse(qc: dict[str, Any]) -> MixConfig:
    """Our block, strictly: exactly these keys and values; ``ConfigError`` names the JSON path."""
    f = "quantization_config"
    for key in sorted(set(qc) - CONFIG_KEYS):
        raise ConfigError(f"{f}.{key}", "not a key of the mixprec block", " | ".join(sorted(CONFIG_KEYS)), key)
    for key, want in (("format", FORMAT), ("version", VERSION), ("bits", BITS), ("outliers", OUTLIERS)):
        expect(
            qc.get(key) == want and type(qc.get(key)) is type(want),
            f"{f}.{key}",
            "unsupported",
            repr(want),
            qc.get(key),
        )
    g = qc.get("group_size")
    expect(
        type(g) is int and 16 <= g <= 1 << 20 and g % 16 == 0,
        f"{f}.group_size",
        "must be a multiple of 16",
        "16, 32, ...",
        g,
    )
    lists: dict[str, tuple[str, ...]] = {}
    for key in ("targets", "ignore"):
        v = qc.get(key)
        ok = isinstance(v, list) and all(isinstance(i, str) for i in v)  # pyright: ignore[reportUnknownVariableType]
        expect(ok, f"{f}.{key}", "must be a list of module names", "[str, ...]", v)
        lists[key] = tuple(v)  # type: ignore[arg-type]
    expect(bool(lists["targets"]), f"{f}.targets", "must name the mixprec Linears", "a non-empty list", [])
    assert isinstance(g, int)
    return MixConfig(MixScheme(g), lists["targets"], lists["ignore"])
