"""Check an ONNX model's external data before onnxruntime reads it (the rules are in ``external.py``).

``check_external_data(model, model_dir, model_file)`` walks every tensor (initializers, sparse
initializers, node attributes, subgraphs, functions) and raises ``ArtifactError`` on the first
reference that breaks a rule, naming the tensor, the field, and what was expected and found.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import onnx

from qcompiler.artifact.reader import ArtifactError
from qcompiler.backends.onnx.external import (
    ALLOWED_KEYS,
    DECIMAL,
    MAX_INT,
    TYPED_FIELDS,
    ExternalRef,
    tensor_nbytes,
)
from qcompiler.paths import PathError, check_rel, open_in


def _graph_tensors(g: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    yield from ((t.name, t) for t in g.initializer)
    for s in g.sparse_initializer:
        yield f"{s.values.name}.values", s.values
        yield f"{s.values.name}.indices", s.indices
    for node in g.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    where = node.name or node.op_type
    for a in node.attribute:
        if a.HasField("t"):
            yield a.t.name or f"{where}.{a.name}", a.t
        for i, t in enumerate(a.tensors):
            yield t.name or f"{where}.{a.name}[{i}]", t
        sparse = [a.sparse_tensor] if a.HasField("sparse_tensor") else []
        for s in [*sparse, *a.sparse_tensors]:
            name = s.values.name or f"{where}.{a.name}"
            yield f"{name}.values", s.values
            yield f"{name}.indices", s.indices
        if a.HasField("g"):
            yield from _graph_tensors(a.g)
        for sub in a.graphs:
            yield from _graph_tensors(sub)


def _model_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    yield from _graph_tensors(model.graph)
    for f in model.functions:
        for node in f.node:
            yield from _node_tensors(node)
    for info in model.training_info:
        yield from _graph_tensors(info.initialization)
        yield from _graph_tensors(info.algorithm)


def _entries(t: onnx.TensorProto, name: str, model_file: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in t.external_data:
        key, value = cast(object, e.key), cast(object, e.value)
        if not isinstance(key, str) or not isinstance(value, str):  # protobuf hands back bytes that are not UTF-8
            raise ArtifactError(
                "external_data entry is not valid UTF-8 text",
                file=model_file,
                tensor=name,
                field="external_data",
                expected="UTF-8 key and value",
                found=repr(key if not isinstance(key, str) else value)[:80],
            )
        field = f"external_data.{e.key}" if e.key in ALLOWED_KEYS or e.key == "checksum" else "external_data"
        if e.key == "checksum":
            raise ArtifactError(
                "checksum key is refused (qcompiler never emits it)",
                file=model_file,
                tensor=name,
                field=field,
                expected=f"only {', '.join(ALLOWED_KEYS)}",
                found="checksum",
            )
        if e.key not in ALLOWED_KEYS:
            raise ArtifactError(
                "unknown external_data key",
                file=model_file,
                tensor=name,
                field=field,
                expected=f"one of {', '.join(ALLOWED_KEYS)}",
                found=repr(e.key),
            )
        if e.key in out:
            raise ArtifactError(
                "duplicate external_data key",
                file=model_file,
                tensor=name,
                field=field,
                expected="each key at most once",
                found=f"{e.key!r} twice",
            )
        out[e.key] = e.value
    if "location" not in out:
        raise ArtifactError(
            "location is missing",
            file=model_file,
            tensor=name,
            field="external_data.location",
            expected="a relative file name",
            found="no location key",
        )
    return out


def _check_location(location: str, root: Path, name: str, model_file: str) -> None:
    field = "external_data.location"

    def fail(message: str) -> ArtifactError:
        return ArtifactError(
            message,
            file=model_file,
            tensor=name,
            field=field,
            expected="a relative path inside the artifact directory",
            found=repr(location),
        )

    lexical = None
    try:
        check_rel(location, file=model_file, field=field, noun="location")
    except PathError as e:
        lexical = e.message
    if lexical is not None and (not location or "\0" in location or ".." not in location.split("/")):
        raise fail(lexical)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(root / location)]) != real_root:
        raise fail("location escapes the artifact directory")
    if lexical is not None:
        raise fail(lexical)


def _check_file(location: str, root: Path, name: str) -> int:
    """Open the data file under the artifact path policy (no link on the way, a regular file with one
    link, identity from its descriptor); return its size."""
    try:
        fh, st = open_in(root, location, field="external_data.location")
    except PathError as e:
        raise ArtifactError(
            f"data file {e.message}",
            file=location,
            tensor=name,
            field="external_data.location",
            expected=e.expected,
            found=e.found,
        ) from None
    fh.close()
    return st.st_size


def _parse_int(value: str | None, default: int, key: str, name: str, model_file: str) -> int:
    if value is None:
        return default
    if not DECIMAL.fullmatch(value):
        raise ArtifactError(
            f"{key} is not a canonical non-negative decimal integer",
            file=model_file,
            tensor=name,
            field=f"external_data.{key}",
            expected="0 or [1-9][0-9]*",
            found=repr(value),
        )
    if len(value) > len(str(MAX_INT)) or int(value) > MAX_INT:
        raise ArtifactError(
            f"{key} is out of range",
            file=model_file,
            tensor=name,
            field=f"external_data.{key}",
            expected=f"<= {MAX_INT}",
            found=value[:40],
        )
    return int(value)


def _no_inline_data(t: onnx.TensorProto, name: str, model_file: str) -> None:
    inline = ["raw_data"] if t.HasField("raw_data") else []
    inline += [f for f in TYPED_FIELDS if len(getattr(t, f)) > 0]
    if inline:
        raise ArtifactError(
            "tensor carries inline data as well as external data",
            file=model_file,
            tensor=name,
            field=inline[0],
            expected="no inline data",
            found=", ".join(inline),
        )


def _nbytes(t: onnx.TensorProto, name: str, model_file: str) -> int:
    try:
        return tensor_nbytes(t)
    except ValueError as e:
        raise ArtifactError(
            f"tensor has no computable byte size: {e}", file=model_file, tensor=name, field="dims/data_type"
        ) from None


def _check_tensor(t: onnx.TensorProto, name: str, root: Path, model_file: str) -> ExternalRef:
    if t.data_location != onnx.TensorProto.EXTERNAL:
        raise ArtifactError(
            "external_data entries on a tensor whose data_location is not EXTERNAL",
            file=model_file,
            tensor=name,
            field="data_location",
            expected="EXTERNAL",
            found=t.data_location,
        )
    entries = _entries(t, name, model_file)
    location = entries["location"]
    _no_inline_data(t, name, model_file)
    _check_location(location, root, name, model_file)
    size = _check_file(location, root, name)
    nbytes = _nbytes(t, name, model_file)
    offset = _parse_int(entries.get("offset"), 0, "offset", name, model_file)
    length = _parse_int(entries.get("length"), nbytes, "length", name, model_file)
    if length != nbytes:
        raise ArtifactError(
            "length does not match the tensor's dims and type",
            file=model_file,
            tensor=name,
            field="external_data.length",
            expected=nbytes,
            found=length,
        )
    if offset + length > size:
        raise ArtifactError(
            "offset + length past the end of the file",
            file=location,
            tensor=name,
            field="external_data.offset",
            expected=f"<= {size} bytes",
            found=offset + length,
        )
    return ExternalRef(tensor=name, location=location, offset=offset, length=length)


def check_external_data(model: onnx.ModelProto, model_dir: Path, model_file: str) -> list[ExternalRef]:
    """Check every external-data reference of ``model`` (saved as ``model_dir / model_file``) by the module's rules.

    Walks graph initializers, sparse initializers, node-attribute tensors, subgraphs, functions and training info.
    Raises ``ArtifactError`` on the first problem; returns the references in model order.
    """
    refs: list[ExternalRef] = []
    for name, t in _model_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data) > 0:
            refs.append(_check_tensor(t, name, model_dir, model_file))
    return refs
