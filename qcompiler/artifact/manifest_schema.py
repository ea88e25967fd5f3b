"""The manifest's schema, checked by the reader before any field is used (gate ``manifest``).

Every top-level key, its type and, where a reader or the runtime interprets it, its range; nothing
else may appear. Backend-specific ``versions`` keys are allowed as JSON scalars, lists and objects:
the backend that reads them checks them. ``check(manifest)`` raises ``ArtifactError`` naming
``manifest.json`` and the dotted field, with the type expected and found, so no later
``manifest.get(...).get(...)`` meets a list where it expects an object.

    check({"target": "gguf", ...})       # ArtifactError: manifest.json: topology.tp: ... (expected int >= 1, found 'x')

The spec is a small table language: a Python type (``str``, ``int``, ``bool``, ``float`` for any
number, ``type(None)``), ``Opt(spec)``, ``ListOf(spec)``, ``MapOf(spec)`` (string keys), ``Obj`` (named
fields; ``extra`` for the rest), ``Hex64``, ``IntRange(lo, hi)``, or ``ANY`` (any JSON value).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from qcompiler.errors import FileError

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class SchemaError(FileError):
    """A manifest field has the wrong type or range."""


@dataclass(frozen=True)
class Opt:
    spec: Any


@dataclass(frozen=True)
class ListOf:
    spec: Any
    most: int = 1 << 20


@dataclass(frozen=True)
class MapOf:
    spec: Any
    most: int = 1 << 20


@dataclass(frozen=True)
class IntRange:
    lo: int
    hi: int = 1 << 62


@dataclass(frozen=True)
class Obj:
    fields: dict[str, Any]
    optional: frozenset[str] = field(default_factory=frozenset[str])
    extra: Any = None
    """Spec of keys not in ``fields`` (``None``: refused)."""


class _Hex64:
    """A 64-digit lowercase hex sha256."""


class _Any:
    """Any JSON value."""


Hex64 = _Hex64()
ANY = _Any()
NUMBER = float

PROBE = Obj({"inputs": str, "norm": NUMBER, "projections": ListOf(NUMBER, most=64), "tolerance": NUMBER})


def parity(decode_field: str) -> Obj:
    """The ``parity`` record whose rung 2 holds each decode's digest under ``decode_field``."""
    return Obj(
        {
            "ok": bool,
            "failures": ListOf(str),
            "rung1_pack_unpack": Obj({"passed": IntRange(0), "weights": IntRange(0)}),
            "rung2_reconstruction": Obj(
                {"bit_exact": IntRange(0), decode_field: MapOf(Hex64), "reference": str, "weights": IntRange(0)}
            ),
            "rung3_operators": MapOf(MapOf(NUMBER)),
            "graph_probe": PROBE,
        },
        optional=frozenset({"graph_probe"}),
    )


DECODE_FIELDS = {1: "decode_sha256", 2: "decode_blake3"}
"""``versions.artifact_schema`` -> the field of rung 2's decode digests (``qcompiler.decode_digest``).
Schema 2 changed only that: BLAKE3 digests of the decodes instead of sha256."""


def schema(version: int) -> Obj:
    """The manifest schema of ``versions.artifact_schema`` ``version`` (one of ``DECODE_FIELDS``)."""
    fields = dict(SCHEMA.fields)
    fields["parity"] = parity(DECODE_FIELDS[version])
    return Obj(fields, SCHEMA.optional, SCHEMA.extra)


SCHEMA = Obj(
    {
        "target": str,
        "versions": Obj(
            {
                "artifact_schema": int,
                "container": str,
                "graph": str,
                "packing_layout": ListOf(str),
                "quant_representation": ListOf(str),
                "required_kernels": ListOf(ANY),
            },
            extra=ANY,
        ),
        "model": Obj({"architecture": str, "model_type": Opt(str), "revision": str}),
        "tokenizer_sha256": Opt(Hex64),
        "provenance": Obj(
            {
                "source": str,
                "source_sha256": str,
                "converter": MapOf(ANY),
                "calibration": ANY,
                "pipeline": str,
                "ir": MapOf(ANY),
                "accuracy_level": IntRange(0, 4),
                "no_cache_graph": bool,
                "onnx_attention": str,
                "quantization_config_sha256": Hex64,
                "package": MapOf(ANY),
            },
            optional=frozenset(
                {"accuracy_level", "no_cache_graph", "onnx_attention", "quantization_config_sha256", "package"}
            ),
        ),
        "topology": Obj(
            {"tp": IntRange(1, 1 << 16), "pp": IntRange(1, 1 << 16), "placement": str},
            extra=ANY,
        ),
        "rate_ledger": MapOf(ANY),
        "conversions": ListOf(MapOf(ANY)),
        "parity": parity(DECODE_FIELDS[2]),
        "files": ListOf(ANY),
        "self_sha256": Hex64,
    }
)


def check(manifest: object, spec: Any = SCHEMA, where: str = "") -> None:
    """Raise ``SchemaError`` at the first field of ``manifest`` that breaks ``spec``."""

    def fail(expected: str) -> SchemaError:
        shown = repr(manifest)
        return SchemaError(
            "wrong type or value",
            file="manifest.json",
            field=where or "(top level)",
            expected=expected,
            found=shown if len(shown) <= 80 else f"{shown[:77]}...",
        )

    if isinstance(spec, _Any):
        return
    if isinstance(spec, Opt):
        if manifest is not None:
            check(manifest, spec.spec, where)
        return
    if isinstance(spec, _Hex64):
        if not isinstance(manifest, str) or not _HEX64.match(manifest):
            raise fail("64 lowercase hex digits")
        return
    if isinstance(spec, IntRange):
        if type(manifest) is not int or not spec.lo <= manifest <= spec.hi:
            raise fail(f"an integer in {spec.lo}..{spec.hi}")
        return
    if isinstance(spec, ListOf):
        if not isinstance(manifest, list) or len(manifest) > spec.most:
            raise fail(f"a list (at most {spec.most} items)")
        for i, item in enumerate(manifest):
            check(item, spec.spec, f"{where}[{i}]")
        return
    if isinstance(spec, MapOf):
        if not isinstance(manifest, dict) or len(manifest) > spec.most:
            raise fail("an object")
        for k, v in manifest.items():
            check(v, spec.spec, f"{where}.{k}" if where else k)
        return
    if isinstance(spec, Obj):
        _check_obj(manifest, spec, where, fail)
        return
    _check_scalar(manifest, spec, fail)


def _check_obj(value: object, spec: Obj, where: str, fail: Any) -> None:
    if not isinstance(value, dict):
        raise fail("an object")
    for key, sub in spec.fields.items():
        path = f"{where}.{key}" if where else key
        if key not in value:
            if key in spec.optional:
                continue
            raise SchemaError("missing", file="manifest.json", field=path, expected="present", found="absent")
        check(value[key], sub, path)
    for key in value:
        if key in spec.fields:
            continue
        path = f"{where}.{key}" if where else key
        if spec.extra is None:
            raise SchemaError(
                "unknown field (a newer schema would change versions.artifact_schema)",
                file="manifest.json",
                field=path,
                expected=" | ".join(spec.fields),
                found=key,
            )
        check(value[key], spec.extra, path)


def _check_scalar(value: object, spec: Any, fail: Any) -> None:
    if spec is float:
        if type(value) not in (int, float):
            raise fail("a number")
        return
    if spec is int:
        if type(value) is not int:
            raise fail("an integer")
        return
    if not isinstance(spec, type) or type(value) is not spec:
        raise fail(getattr(spec, "__name__", str(spec)))
