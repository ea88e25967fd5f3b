"""The safetensors backend's reader gates, run in order; each failure names file, tensor and field.

1. ``config``: config.json parses (bounded, strict) and its ``quantization_config`` is one this
   backend understands (``ct_config.parse``);
2. ``container``: every shard passes the strict container reader (header bounds, offsets, holes,
   overlaps, extents, trailing bytes, duplicate names); no tensor is in two shards;
3. ``index``: with several shards, ``model.safetensors.index.json`` names exactly the shards
   present, maps every tensor to the shard that holds it, and ``total_size`` is the tensor bytes;
   no stray ``model.safetensors`` beside it;
4. ``inventory``: the tensor names and shapes are exactly what the architecture (built from
   config.json on the meta device) and the quantization config imply;
5. ``qparams``: per quantized Linear, ``weight_packed``/``weight_scale``/``weight_zero_point``
   dtypes and shapes follow from ``weight_shape``, bits and group size (a scale grouped along the
   wrong axis is caught here), padding bits are clear and scales finite (a ``mixprec`` Linear, under
   our own config block: ``mixprec_gates.py``);
6. ``graph``: ``graph.qir`` parses and verifies with its tensors read from the container (sha256
   checked, each header entry's dtype and shape the declared ones), codes inside their alphabet, and
   each descriptor agrees with the config; then the graph binds every other byte a consumer reads:
   every tensor of every shard and of ``graph.safetensors`` is referenced by ``graph.qir`` or is a
   ``weight_shape`` the ``qparams`` gate checked, ``__metadata__`` is ``{"format": "pt"}``, each
   hyperparameter of config.json that the graph shows means what it computes
   (``inventory.CONFIG_FACTS``), and every config.json key, the index and every carried file
   (tokenizer, generation config) has the sha256 that ``graph.qir``'s ``bound`` record holds.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

from qcompiler.artifact.reader import GRAPH, ArtifactError, as_artifact, hash_open, read_graph, read_json, tree
from qcompiler.artifact.request import ContainerEntry, OpenedArtifact
from qcompiler.backends.safetensors import blobs, mixprec_gates, mixprec_schema
from qcompiler.backends.safetensors.container import SafetensorsFile, open_file
from qcompiler.backends.safetensors.ct_config import ConfigError, ParsedConfig, WeightScheme, parse, scheme_of
from qcompiler.backends.safetensors.inventory import InventoryError, architecture_inventory, check_config_facts
from qcompiler.backends.safetensors.layouts import padding_bits_clear, words_per_row
from qcompiler.backends.safetensors.mixprec_schema import MixConfig, MixScheme
from qcompiler.backends.safetensors.plan import GRAPH_FILE, INDEX, quant_weights
from qcompiler.errors import FileError
from qcompiler.ir.core import Module
from qcompiler.ir.facts import check_recorded, digest
from qcompiler.paths import PathError, open_in

Where = dict[str, tuple[str, SafetensorsFile]]
"""Tensor name -> (shard file name, opened shard)."""
Scheme = WeightScheme | MixScheme


def shard_files(root: Path) -> list[str]:
    """Gate ``index`` (first half): which shard files make up the checkpoint."""
    if not (root / INDEX).exists():
        if not (root / "model.safetensors").is_file():
            raise ArtifactError(
                "no model.safetensors and no index",
                file="model.safetensors",
                expected="a checkpoint file",
                found="none",
            )
        return ["model.safetensors"]
    if (root / "model.safetensors").exists():
        raise ArtifactError(
            "stray single-file checkpoint next to an index (transformers would load it and ignore the shards)",
            file="model.safetensors",
        )
    index = read_json(root, INDEX)
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    meta = index.get("metadata") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not isinstance(meta, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ArtifactError("must hold metadata and a weight_map of tensor -> file", file=INDEX, field="weight_map")
    names = sorted(set(wmap.values()))
    for name in names:
        if "/" in name or name.startswith(".") or not (root / name).is_file():
            raise ArtifactError(
                "shard named by the index is missing",
                file=INDEX,
                field="weight_map",
                expected="an existing shard file",
                found=name,
            )
    return names


def open_shards(root: Path, files: list[str]) -> Where:
    """Gate ``container``."""
    where: Where = {}
    for name in files:
        try:
            fh, _ = open_in(root, name)
        except PathError as e:
            raise as_artifact(e) from None
        f = open_file(root / name, fh=fh)
        for tensor in f.tensors:
            if tensor in where:
                raise ArtifactError(
                    "tensor stored in two shards",
                    file=name,
                    tensor=tensor,
                    expected="one shard",
                    found=f"also in {where[tensor][0]}",
                )
            where[tensor] = (name, f)
    return where


def check_index(root: Path, where: Where) -> None:
    """Gate ``index`` (second half): weight_map and total_size agree with the shards."""
    index: dict[str, Any] = read_json(root, INDEX)
    wmap: dict[str, str] = index["weight_map"]
    for tensor, (file, _) in sorted(where.items()):
        if tensor not in wmap:
            raise ArtifactError(
                "tensor missing from the weight_map",
                file=INDEX,
                tensor=tensor,
                field="weight_map",
                expected=file,
                found="no entry",
            )
        if wmap[tensor] != file:
            raise ArtifactError(
                "weight_map points at the wrong shard",
                file=INDEX,
                tensor=tensor,
                field="weight_map",
                expected=file,
                found=wmap[tensor],
            )
    for tensor in sorted(set(wmap) - set(where)):
        raise ArtifactError(
            "weight_map names a tensor no shard holds",
            file=INDEX,
            tensor=tensor,
            field="weight_map",
            expected="a stored tensor",
            found=wmap[tensor],
        )
    total = sum(f.tensors[t].nbytes for t, (_, f) in where.items())
    found = index["metadata"].get("total_size")
    if found != total:
        raise ArtifactError(
            "is not the sum of tensor bytes", file=INDEX, field="metadata.total_size", expected=total, found=found
        )


def expect_tensor(where: Where, name: str, dtype: set[str], shape: tuple[int, ...], why: str) -> SafetensorsFile:
    file, f = where[name]
    e = f.tensors[name]
    if e.dtype not in dtype:
        raise ArtifactError(
            "wrong dtype", file=file, tensor=name, field="dtype", expected=" | ".join(sorted(dtype)), found=e.dtype
        )
    if e.shape != shape:
        raise ArtifactError(
            f"wrong shape ({why})", file=file, tensor=name, field="shape", expected=list(shape), found=list(e.shape)
        )
    return f


def check_scale(where: Where, module: str, shape: tuple[int, ...], s: WeightScheme) -> int:
    """A quantized Linear's ``weight_scale``: dtype, the shape its strategy gives, finite values;
    returns the number of groups along K."""
    out, k = shape
    groups = 1 if s.strategy in ("channel", "tensor") else -(-k // (s.group_size or 1))
    if s.strategy == "tensor":
        want, why = (1,), "one scale for the tensor"
    elif s.strategy == "channel":
        want, why = (out, 1), "one scale per output row"
    else:
        want, why = (out, groups), f"[out, in/{s.group_size}]: groups of {s.group_size} along the input axis"
    sf = expect_tensor(where, f"{module}.weight_scale", {"F32", "F16", "BF16"}, want, why)
    scale = np.asarray(sf.array(f"{module}.weight_scale"))
    values = (
        (scale.astype(np.uint32) << 16).view(np.float32)
        if scale.dtype == np.uint16 and sf.tensors[f"{module}.weight_scale"].dtype == "BF16"
        else scale
    )
    if not np.isfinite(values).all():
        raise ArtifactError(
            "holds a non-finite scale",
            file=where[f"{module}.weight_scale"][0],
            tensor=f"{module}.weight_scale",
            field="value",
        )
    return groups


def check_quantized(where: Where, module: str, shape: tuple[int, ...], s: WeightScheme) -> None:
    """Gate ``qparams`` for one quantized Linear of logical ``shape`` [out, in]."""
    out, k = shape
    if s.type == "float":  # float-quantized: F8_E4M3 values in ``weight``, symmetric
        expect_tensor(where, f"{module}.weight", {"F8_E4M3"}, (out, k), "the FP8 weight")
        check_scale(where, module, shape, s)
        return
    file, f = where[f"{module}.weight_shape"]
    expect_tensor(where, f"{module}.weight_shape", {"I64"}, (2,), "the logical [out, in] shape")
    stored = [int(v) for v in f.array(f"{module}.weight_shape")]
    if stored != [out, k]:
        raise ArtifactError(
            "disagrees with the architecture",
            file=file,
            tensor=f"{module}.weight_shape",
            field="value",
            expected=[out, k],
            found=stored,
        )
    packed = f"{module}.weight_packed"
    pf = expect_tensor(
        where,
        packed,
        {"I32"},
        (out, words_per_row(k, s.num_bits)),
        f"{k} {s.num_bits}-bit codes per row in int32 words",
    )
    if not padding_bits_clear(np.asarray(pf.array(packed)), s.num_bits, k):
        raise ArtifactError(
            "bits after the last code of a row are set",
            file=where[packed][0],
            tensor=packed,
            field="padding",
            expected="0",
            found="non-zero",
        )
    groups = check_scale(where, module, shape, s)
    zp = f"{module}.weight_zero_point"
    if s.symmetric and zp in where:
        raise ArtifactError(
            "zero point stored for a symmetric scheme",
            file=where[zp][0],
            tensor=zp,
            expected="no tensor",
            found="a tensor",
        )
    if not s.symmetric:
        if zp not in where:
            raise ArtifactError(
                "asymmetric scheme without zero points", file=file, tensor=zp, expected="a tensor", found="none"
            )
        expect_tensor(where, zp, {"I32"}, (words_per_row(out, s.num_bits), groups), "packed along dim 0")


def check_inventory(where: Where, config: dict[str, Any], qc: ParsedConfig | MixConfig) -> dict[str, Scheme]:
    """Gates ``inventory`` and ``qparams`` (a mixprec Linear: ``mixprec_gates``); returns the schemes."""
    try:
        inv = architecture_inventory(config, max_layers=max(1, len(where)))
    except InventoryError as e:
        raise ArtifactError(str(e), file="config.json", field=e.field) from None
    expected: dict[str, tuple[int, ...] | None] = {}
    quantized: dict[str, Scheme] = {}
    for name, (shape, _) in inv.tensors.items():
        module = name.removesuffix(".weight")
        s = qc.scheme_for(module, module in inv.linears) if name.endswith(".weight") else None
        if s is None:
            expected[name] = shape
            continue
        quantized[module] = s
        if isinstance(s, MixScheme):
            expected |= {f"{module}.{suffix}": None for suffix in mixprec_gates.suffixes(where, module)}
            continue
        packed = ("weight_packed", "weight_scale", "weight_shape") + (() if s.symmetric else ("weight_zero_point",))
        for suffix in ("weight", "weight_scale") if s.type == "float" else packed:
            expected[f"{module}.{suffix}"] = None
    for name in expected:
        if name not in where:
            raise ArtifactError(
                f"missing from the checkpoint ({inv.architecture} needs it)",
                file="<checkpoint>",
                tensor=name,
                expected="a tensor",
                found="none",
            )
    for name in where:
        if name not in expected:
            raise ArtifactError(
                f"not a tensor of {inv.architecture} under this quantization config",
                file=where[name][0],
                tensor=name,
                expected="no such tensor",
                found="a tensor",
            )
    for name, shape in expected.items():
        if shape is not None and where[name][1].tensors[name].shape != shape:
            raise ArtifactError(
                "wrong shape for the architecture",
                file=where[name][0],
                tensor=name,
                field="shape",
                expected=list(shape),
                found=list(where[name][1].tensors[name].shape),
            )
    for module, s in quantized.items():
        shape = inv.tensors[f"{module}.weight"][0]
        if isinstance(s, MixScheme):
            mixprec_gates.check_weight(where, module, shape, s)
        else:
            check_quantized(where, module, shape, s)
    return quantized


def same_scheme(have: WeightScheme, want: WeightScheme, k: int) -> bool:
    """Equal, or equal but for one group spanning the row written as a group of ``k`` (``ct_config.build``)."""
    row = WeightScheme(have.num_bits, have.symmetric, "group", k) if have.strategy == "channel" else have
    return want in (have, row)


def check_graph(root: Path, quantized: dict[str, Scheme]) -> Module:
    """Gate ``graph``."""
    m = read_graph(root)
    mixprec_gates.check_descriptors(m, dict(quantized))
    for w in quant_weights(m):
        want = quantized.get(w.module)
        if not isinstance(want, WeightScheme) or not same_scheme(scheme_of(w.t), want, int(w.t.shape[1])):
            raise ArtifactError(
                "descriptor disagrees with the quantization config",
                file="graph.qir",
                tensor=w.name,
                expected=want,
                found=scheme_of(w.t),
            )
    return m


CONFIG = "config.json"
CONFIG_SECTION, FILES_SECTION = "config", "files"
"""Sections of ``graph.qir``'s ``bound`` record: config.json's keys, and the files carried beside it."""


def file_digests(root: Path, names: list[str]) -> dict[str, str]:
    """sha256 of each named artifact file, opened under the path policy."""
    out: dict[str, str] = {}
    for rel in names:
        try:
            fh, _ = open_in(root, rel)
        except PathError as e:
            raise as_artifact(e) from None
        with fh:
            out[rel] = hash_open(fh)[1]
    return out


def config_digests(config: dict[str, Any]) -> dict[str, str]:
    """config.json key -> sha256 of its value's canonical JSON (the ``config`` section of the record)."""
    return {key: digest(value) for key, value in config.items()}


def check_binding(root: Path, m: Module, where: Where, quantized: dict[str, Scheme], config: dict[str, Any]) -> None:
    """Gate ``graph``, second half: every byte a consumer reads is bound by ``graph.qir`` (see above)."""
    shapes = {f"{module}.weight_shape" for module, s in quantized.items() if getattr(s, "type", "") != "float"}
    shards = sorted({file for file, _ in where.values()})
    for file in shards:
        blobs.check_bound(file, blobs.opened_checked(root, file), m, shapes)
    if (root / GRAPH_FILE).exists():
        blobs.check_bound(GRAPH_FILE, blobs.opened_checked(root, GRAPH_FILE), m)
    check_config_facts(config, m)
    own = {*shards, CONFIG, GRAPH, GRAPH_FILE}
    carried = sorted(rel for rel in tree(root) if rel not in own)
    try:
        check_recorded(m, CONFIG_SECTION, config_digests(config), file=CONFIG)
        check_recorded(m, FILES_SECTION, file_digests(root, carried), noun="file")
    except FileError as e:
        raise as_artifact(e) from None


def open_safetensors(root: Path, manifest: dict[str, Any] | None) -> OpenedArtifact:
    config = read_json(root, "config.json")
    if not isinstance(config, dict):
        raise ArtifactError("must be a JSON object", file="config.json")
    try:
        raw = config.get("quantization_config")
        none = raw is None and "quantization_config" not in config
        qc = (
            mixprec_schema.parse(raw)
            if mixprec_schema.is_mixprec(raw)
            else ParsedConfig((), ())
            if none
            else parse(raw)
        )
    except ConfigError as e:
        raise ArtifactError(e.message, file="config.json", field=e.field, expected=e.expected, found=e.found) from None
    gates = ["config"]
    files = shard_files(root)
    where = open_shards(root, files)
    gates.append("container")
    if len(files) > 1 or (root / INDEX).exists():
        check_index(root, where)
        gates.append("index")
    quantized = check_inventory(where, copy.deepcopy(config), qc)  # transformers fills defaults in place
    gates += ["inventory", "qparams"]
    module = check_graph(root, quantized)
    check_binding(root, module, where, quantized, config)
    gates.append("graph")
    entries = [
        ContainerEntry(t, file, f.tensors[t].dtype, f.tensors[t].shape, f.tensors[t].nbytes)
        for t, (file, f) in where.items()
    ]
    files = set(tree(root))  # shards, config, graph files and carried files: the graph gate bound each
    return OpenedArtifact(root, "safetensors", manifest, module, entries, gates, config, files)
