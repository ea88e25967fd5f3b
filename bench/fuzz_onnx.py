"""ONNX protobuf edits for ``bench/fuzz.py``: node attributes, op_type and domain, node wiring,
initializer dims, data_type and raw_data, external-data entries (location, offset, length),
opset and ir_version, graph input and output types."""

from __future__ import annotations

import random
from typing import Any, cast

import onnx
from fuzz_formats import interesting_int

OP_TYPES = ["MatMulNBits", "MatMul", "Add", "Identity", "Gather", "Reshape", "DequantizeLinear", "Loop", "Bogus"]
DOMAINS = ["", "com.microsoft", "ai.onnx.ml", "evil.domain", "ai.onnx"]
LOCATIONS = ["../outside/x", "/etc/passwd", "model.onnx", "missing.data", "model.onnx.data/", "./model.onnx.data"]
DATA_TYPES = [0, 1, 2, 3, 6, 7, 10, 11, 16, 17, 21, 22, 99]


def edit_model(model: onnx.ModelProto, rng: random.Random) -> tuple[str, str]:
    """One edit, in place; returns (where, detail)."""
    g = model.graph
    op = rng.choice(["attr", "attr", "attr", "op_type", "domain", "wire", "node", "init", "init", "external"] * 2)
    op = rng.choice([op, op, op, "model", "io"])
    if op == "attr":
        return edit_attribute(rng.choice([n for n in g.node if n.attribute]), rng)
    if op in ("op_type", "domain"):
        node = rng.choice(list(g.node))
        old = node.op_type if op == "op_type" else node.domain
        new = rng.choice(OP_TYPES if op == "op_type" else DOMAINS)
        setattr(node, op, new)
        return f"node {op} {old}", f"{node.name}: {op} {old!r} -> {new!r}"
    if op == "wire":
        node = rng.choice(list(g.node))
        values = [v for n in g.node for v in n.output] + [i.name for i in g.initializer]
        ios = node.input if rng.random() < 0.6 or not node.output else node.output
        if not ios:
            return "node wiring (no inputs)", f"{node.name}: unchanged"
        k = rng.randrange(len(ios))
        old = ios[k]
        ios[k] = rng.choice([rng.choice(values), "", old + "x", node.output[0] if node.output else "y"])
        return f"node {node.op_type} wiring", f"{node.name}: {old!r} -> {ios[k]!r}"
    if op == "node":
        k = rng.randrange(len(g.node))
        kind = rng.choice(["delete", "duplicate", "swap"])
        name = g.node[k].name
        if kind == "delete":
            del g.node[k]
        elif kind == "duplicate":
            g.node.insert(k, g.node[k])
        else:
            j = min(len(g.node) - 1, k + 1)
            a, b = onnx.NodeProto(), onnx.NodeProto()
            a.CopyFrom(g.node[k])
            b.CopyFrom(g.node[j])
            g.node[k].CopyFrom(b)
            g.node[j].CopyFrom(a)
        return f"node {kind}", f"{name} {kind}"
    if op in ("init", "external"):
        pool = [t for t in g.initializer if (t.data_location == 1) == (op == "external")] or list(g.initializer)
        t = rng.choice(pool)
        return edit_external(t, rng) if t.data_location == 1 else edit_initializer(t, rng)
    if op == "io":
        vi = rng.choice(list(g.input) + list(g.output))
        tt = vi.type.tensor_type
        if rng.random() < 0.5 or not tt.shape.dim:
            old_type, tt.elem_type = tt.elem_type, rng.choice(DATA_TYPES)
            return "graph io elem_type", f"{vi.name}: elem_type {old_type} -> {tt.elem_type}"
        d = rng.choice(list(tt.shape.dim))
        old_dim = d.dim_value or d.dim_param
        d.dim_value = rng.choice([1, 2, 7, 2**40])
        return "graph io dim", f"{vi.name}: dim {old_dim!r} -> {d.dim_value}"
    kind = rng.choice(["ir_version", "opset", "opset", "add_opset", "producer"])
    if kind == "ir_version":
        old_v, model.ir_version = model.ir_version, rng.choice([0, 3, 7, 11, 12, 99])
        return "model ir_version", f"ir_version {old_v} -> {model.ir_version}"
    if kind == "opset":
        imp = rng.choice(list(model.opset_import))
        old_v, imp.version = imp.version, rng.choice([1, 7, 13, 20, 22, 99])
        return f"model opset {imp.domain or 'ai.onnx'}", f"opset {imp.domain!r} {old_v} -> {imp.version}"
    if kind == "add_opset":
        imp = model.opset_import.add()
        imp.domain, imp.version = rng.choice([("", 13), ("com.microsoft", 2), ("ai.onnx.ml", 3)])
        return "model opset duplicate", f"opset {imp.domain!r} v{imp.version} added"
    model.producer_name = "fuzz"
    return "model producer_name", "producer_name -> 'fuzz'"


def edit_attribute(node: onnx.NodeProto, rng: random.Random) -> tuple[str, str]:
    a = rng.choice(list(node.attribute))
    where = f"attribute {node.op_type}.{a.name}"
    kind = rng.choice(["value", "value", "value", "type", "rename", "delete", "dup"])
    if kind == "value":
        if a.type == onnx.AttributeProto.INT:
            old: object = a.i
            a.i = interesting_int(rng, a.i)
            return where, f"{node.name}: {a.name} {old} -> {a.i}"
        if a.type == onnx.AttributeProto.FLOAT:
            old, a.f = a.f, rng.choice([float("nan"), float("inf"), 0.0, -a.f, a.f * 2, 1e38])
            return where, f"{node.name}: {a.name} {old} -> {a.f}"
        if a.type == onnx.AttributeProto.INTS and a.ints:
            k = rng.randrange(len(a.ints))
            old = list(a.ints)
            a.ints[k] = interesting_int(rng, a.ints[k])
            return where, f"{node.name}: {a.name} {old} -> {list(a.ints)}"
        if a.type == onnx.AttributeProto.TENSOR:
            t = a.t
            old = bytes(t.raw_data[:8])
            if t.raw_data:
                raw = bytearray(t.raw_data)
                raw[rng.randrange(len(raw))] ^= 0x40
                t.raw_data = bytes(raw)
            else:
                t.dims.append(2)
            return where, f"{node.name}: {a.name} tensor {old.hex()} -> {bytes(t.raw_data[:8]).hex()}"
        a.s = rng.choice([b"", b"x", a.s + b"x", b"\xff"])
        return where, f"{node.name}: {a.name} bytes -> {a.s!r}"
    if kind == "type":
        old_type = a.type
        a.type = cast(Any, rng.choice([t for t in range(1, 15) if t != a.type]))
        return f"{where} type", f"{node.name}: {a.name} type {old_type} -> {a.type}"
    if kind == "rename":
        old_name = a.name
        a.name = rng.choice(["K", "N", "bits", "block_size", "axis", "perm", a.name + "x", ""])
        return f"{where} rename", f"{node.name}: attribute {old_name} -> {a.name!r}"
    if kind == "delete":
        node.attribute.remove(a)
        return f"{where} delete", f"{node.name}: attribute {a.name} deleted"
    node.attribute.append(a)
    return f"{where} duplicate", f"{node.name}: attribute {a.name} twice"


def edit_initializer(t: onnx.TensorProto, rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["dims", "dims", "data_type", "raw", "name", "location"])
    if kind == "dims":
        old = list(t.dims)
        if t.dims and rng.random() < 0.6:
            k = rng.randrange(len(t.dims))
            t.dims[k] = interesting_int(rng, t.dims[k])
        else:
            t.dims.append(rng.choice([1, 2, 0]))
        return "initializer dims", f"{t.name}: dims {old} -> {list(t.dims)}"
    if kind == "data_type":
        old_type, t.data_type = t.data_type, rng.choice([x for x in DATA_TYPES if x != t.data_type])
        return "initializer data_type", f"{t.name}: data_type {old_type} -> {t.data_type}"
    if kind == "raw" and t.raw_data:
        raw = bytearray(t.raw_data)
        op = rng.choice(["flip", "truncate", "extend"])
        if op == "flip":
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif op == "truncate":
            del raw[-1]
        else:
            raw += b"\x00" * 4
        t.raw_data = bytes(raw)
        return f"initializer raw_data {op}", f"{t.name}: raw_data {op} ({len(raw)} bytes)"
    if kind == "location":
        t.data_location = cast(Any, 1)
        return "initializer data_location", f"{t.name}: data_location -> EXTERNAL without entries"
    old_name = t.name
    t.name = rng.choice([t.name + "x", ""])
    return "initializer name", f"initializer {old_name} renamed {t.name!r}"


def edit_external(t: onnx.TensorProto, rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["location", "offset", "offset", "length", "length", "add", "delete", "dims", "inline"])
    entries = {e.key: e for e in t.external_data}
    if kind in ("location", "offset", "length") and kind in entries:
        e = entries[kind]
        old = e.value
        if kind == "location":
            e.value = rng.choice(LOCATIONS)
        else:
            n = int(old) if old.isdigit() else 0
            e.value = rng.choice([str(n + 1), str(n - 1), str(n + 4096), "-1", "x", str(2**63), "0", " 1", "1e3"])
        return f"external_data {kind}", f"{t.name}: {kind} {old!r} -> {e.value!r}"
    if kind == "add":
        e = t.external_data.add()
        e.key, e.value = rng.choice([("checksum", "0"), ("basepath", "/"), ("location", "other.data"), ("x", "")])
        return f"external_data add {e.key}", f"{t.name}: external_data {e.key}={e.value!r} added"
    if kind == "delete" and t.external_data:
        k = rng.randrange(len(t.external_data))
        key = t.external_data[k].key
        del t.external_data[k]
        return f"external_data delete {key}", f"{t.name}: external_data {key} deleted"
    if kind == "inline":
        t.raw_data = b"\x00" * 8
        return "external_data with inline raw_data", f"{t.name}: raw_data added beside external data"
    old = list(t.dims)
    if t.dims:
        t.dims[0] = t.dims[0] * 2
    return "external initializer dims", f"{t.name}: dims {old} -> {list(t.dims)}"
