"""Module and tensor-table attributes: the values their writers use, and the verifier's checks of them.

The tables here are the single list of known values; the passes that write an attribute import
their constants from this module (imports point down: passes sit above the IR)::

    module @m attributes {topology = {tp = 1, pp = 1}, qdq_form = "fold",
                          file_shards = {target = "safetensors", count = 2, max_size = 5000000000}} {
      tensor @w.codes : i8[64,64] = blob<"sha256:…", "mem"> {placement = "replicate", file_shard = 2}
      tensor @rope.inv_freq : f32[8] = blob<"sha256:…", "mem"> {role = "constant", placement = "replicate"}
      ...
    }

| attribute | on | holds | written by |
|---|---|---|---|
| ``topology`` | module | exactly ``{tp, pp}``, ints >= 1 | ``place-shards`` |
| ``file_shards`` | module | exactly ``{target, count, max_size}``: a non-empty string, ints >= 1 | ``place-shards`` |
| ``qdq_form`` | module | ``QDQ_FORMS`` | ``fuse-qdq`` |
| ``placement`` | tensor | ``PLACEMENTS`` | ``place-shards`` |
| ``file_shard`` | tensor | an int in ``1..file_shards.count`` (needs ``file_shards``) | ``place-shards`` |
| ``role`` | tensor | ``ROLES`` | the frontend (``mark_roles``) |

A tensor attribute not in the table is refused; so is a tensor whose byte size overflows int64.
``invariants`` is checked by ``qcompiler.ir.invariants``.

Facts passes share are read through the typed accessors at the end of this module (``target_of``,
``source_formats``, ``conversions``, ``qdq_form``, ``model_dtype``), so no pass imports another to read
what it recorded.
"""

from __future__ import annotations

import json

from qcompiler.errors import VerifyError
from qcompiler.ir.attrs import AttrValue, attr_kind, format_attr
from qcompiler.ir.core import Module, TensorDecl

PLACEMENT_REPLICATE = "replicate"
PLACEMENTS = (PLACEMENT_REPLICATE,)
"""Tensor placements over the parallel topology (``place-shards``; tp=1 replicates every tensor)."""

QDQ_FOLD = "fold"
QDQ_MATERIALIZE = "materialize"
QDQ_FORMS = (QDQ_FOLD, QDQ_MATERIALIZE)
"""``qdq_form``: weight dequantizes folded into ``q.linear``/``q.embedding``, or materialized (``fuse-qdq``)."""

ROLE_CONSTANT = "constant"
ROLE_CARRIED = "carried"
ROLES = (ROLE_CONSTANT, ROLE_CARRIED)
"""``role``: a graph-only constant (no checkpoint tensor), or a checkpoint tensor the graph never reads."""

TOPOLOGY_FIELDS = ("tp", "pp")
FILE_SHARDS_FIELDS = ("target", "count", "max_size")
TENSOR_ATTRS = ("placement", "file_shard", "role")
INT64_MAX = 2**63 - 1


def int_in(v: AttrValue, lo: int, hi: int) -> bool:
    """``v`` is an int (not a bool) in ``[lo, hi]``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def module_error(m: Module, field: str, message: str, expected: str, found: str) -> VerifyError:
    return VerifyError(message, where=f"module @{m.name}", field=field, expected=expected, found=found, loc=m.loc)


def check_record(m: Module, name: str, fields: tuple[str, ...]) -> dict[str, AttrValue] | None:
    """The module attribute ``name`` as a dict with exactly ``fields`` (``None`` when absent)."""
    raw = m.attrs.get(name)
    if raw is None:
        return None
    shape = "{" + ", ".join(f"{f} = ..." for f in fields) + "}"
    if not isinstance(raw, dict):
        raise module_error(m, name, "must be a record", shape, attr_kind(raw))
    if sorted(raw) != sorted(fields):
        raise module_error(m, name, "has the wrong fields", ", ".join(fields), ", ".join(raw) or "none")
    return raw


def check_positive(m: Module, field: str, value: AttrValue) -> int:
    if not int_in(value, 1, INT64_MAX):
        raise module_error(m, field, "must be an integer >= 1", "an int >= 1", format_attr(value))
    assert isinstance(value, int)
    return value


def check_module_attrs(m: Module) -> None:
    """``topology``, ``file_shards``, ``qdq_form`` and every tensor's attributes (see the table)."""
    topology = check_record(m, "topology", TOPOLOGY_FIELDS)
    if topology is not None:
        for key in TOPOLOGY_FIELDS:
            check_positive(m, f"topology.{key}", topology[key])
    shards = check_record(m, "file_shards", FILE_SHARDS_FIELDS)
    count: int | None = None
    if shards is not None:
        target = shards["target"]
        if not isinstance(target, str) or not target:
            raise module_error(m, "file_shards.target", "must name a target", "a target name", format_attr(target))
        count = check_positive(m, "file_shards.count", shards["count"])
        check_positive(m, "file_shards.max_size", shards["max_size"])
    form = m.attrs.get("qdq_form")
    if form is not None and form not in QDQ_FORMS:
        raise module_error(m, "qdq_form", "unknown QDQ form", " | ".join(QDQ_FORMS), format_attr(form))
    for decl in m.tensors.values():
        check_tensor_attrs(decl, count)


def tensor_error(decl: TensorDecl, field: str, message: str, expected: str, found: str) -> VerifyError:
    return VerifyError(message, where=f"tensor @{decl.name}", field=field, expected=expected, found=found, loc=decl.loc)


def check_tensor_attrs(decl: TensorDecl, shard_count: int | None) -> None:
    """One tensor-table entry: known attributes with known values, a byte size that fits int64."""
    if decl.blob.nbytes > INT64_MAX:
        raise tensor_error(
            decl, "type", "tensor is larger than int64 bytes", f"at most {INT64_MAX} bytes", decl.type_str()
        )
    for key in decl.attrs:
        if key not in TENSOR_ATTRS:
            raise tensor_error(decl, key, "unknown tensor attribute", " | ".join(TENSOR_ATTRS), key)
    placement = decl.attrs.get("placement")
    if placement is not None and placement not in PLACEMENTS:
        raise tensor_error(decl, "placement", "unknown placement", " | ".join(PLACEMENTS), format_attr(placement))
    role = decl.attrs.get("role")
    if role is not None and role not in ROLES:
        raise tensor_error(decl, "role", "unknown tensor role", " | ".join(ROLES), format_attr(role))
    shard = decl.attrs.get("file_shard")
    if shard is None:
        return
    if shard_count is None:
        raise tensor_error(
            decl, "file_shard", "names a file shard, but the module has no file_shards", "no file_shard", str(shard)
        )
    if not int_in(shard, 1, shard_count):
        raise tensor_error(
            decl, "file_shard", "file shard out of range", f"an int in 1..{shard_count}", format_attr(shard)
        )


# --------------------------------------------------------------------------- facts passes share


def target_of(m: Module) -> str | None:
    """The target ``place-shards`` planned the file shards for (``file_shards.target``)."""
    shards = m.attrs.get("file_shards")
    target = shards.get("target") if isinstance(shards, dict) else None
    return target if isinstance(target, str) and target else None


def source_formats(m: Module) -> dict[str, str]:
    """Weight name -> the block format its source stored it in (``freeze-semantics`` records it)."""
    raw = m.attrs.get("source_formats")
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def conversions(m: Module) -> list[AttrValue]:
    """The conversion records ``pack-layouts`` made (each a dict naming its ``tensor``), in order."""
    raw = m.attrs.get("conversions")
    return list(raw) if isinstance(raw, list) else []


def qdq_form(m: Module) -> str:
    """``fuse-qdq``'s form (``QDQ_FOLD`` until it says otherwise)."""
    form = m.attrs.get("qdq_form", QDQ_FOLD)
    return form if isinstance(form, str) else QDQ_FOLD


def model_dtype(m: Module) -> str:
    """The dtype the source's config declares (``bf16``; empty when it declares none)."""
    prov = m.attrs.get("provenance")
    return str(prov.get("model_dtype", "")) if isinstance(prov, dict) else ""


def activation_schemes(m: Module) -> dict[str, str]:
    """Module -> the activation scheme its source declared and the graph does not apply (canonical
    JSON: a compressed-tensors FP8 checkpoint's dynamic ``input_activations``), from the provenance
    (where it is held as one JSON object)."""
    prov = m.attrs.get("provenance")
    raw = prov.get("activation_schemes") if isinstance(prov, dict) else None
    try:
        parsed = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in parsed.items()} if isinstance(parsed, dict) else {}
