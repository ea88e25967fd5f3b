"""The ONNX backend's reader gates, in order; each failure names file, tensor or node, and field.

Gates 1-3 run on ``model.onnx`` and, when present, ``model_no_cache.onnx``.

1. ``container``: ``model.onnx`` parses (under 2 GiB) and every external-data reference passes
   ``external.check_external_data`` (relative, inside the directory, no links, whitelisted keys,
   bounds and exact lengths) before anything else reads it;
2. ``checker``: ``onnx.checker.check_model(full_check=True)`` on the path;
3. ``nodes``: only the default domain, ``com.microsoft.MatMulNBits`` and
   ``com.microsoft.GroupQueryAttention`` (only the attributes ``gqa.py`` writes, consistent:
   ``check_gqa``); every ``MatMulNBits``'
   attributes agree with its initializers' shapes (``B [N, K/B, B*bits/8]``, ``scales [N, K/B]``,
   packed ``zero_points``), bits in {2, 4, 8}, block a power of two >= 16; every blocked
   ``DequantizeLinear``'s scale and zero point have the blocked shape (onnx.checker does not check it);
   an act-order input ``Gather(x, perm, axis=-1)`` read by a ``MatMulNBits`` (or by a ``MatMul`` of a
   ``DequantizeLinear``) gathers with an int32/int64 ``perm [K]`` initializer;
4. ``graph``: ``graph.qir`` parses and verifies with its tensors read from the ONNX initializers;
5. ``binding`` (with a manifest): the model files and ``model.onnx.data`` are exactly what this
   backend lowers ``graph.qir`` to with the recorded form, accuracy level, no-cache flag and attention form
   (``binding.py``);
6. ``package``: the runtime files (tokenizer, config.json, generation and genai configs) agree with
   ``graph.qir`` and the decoder graph, and have the sha256 ``graph.qir`` binds (``package_check.py``).

Without a manifest (emit's first reopen, before the manifest exists) gate 5 is left to the publish
check, which opens the finished directory with its manifest; gate 6 runs with the accuracy level
emit passes (the level ``genai_config.json``'s session options name).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from qcompiler.artifact.reader import ArtifactError, read_graph
from qcompiler.artifact.request import ContainerEntry, OpenedArtifact
from qcompiler.backends.onnx import gqa
from qcompiler.backends.onnx.binding import check_binding, emit_options
from qcompiler.backends.onnx.blobs import OnnxFile, open_onnx
from qcompiler.backends.onnx.emit import DATA_FILE
from qcompiler.backends.onnx.genai import DECODER_FILE
from qcompiler.backends.onnx.package_check import check_package
from qcompiler.backends.onnx.weights import MODEL_FILE, NO_CACHE_FILE
from qcompiler.errors import QcError

ALLOWED_DOMAINS = {"": None, "com.microsoft": {"MatMulNBits", gqa.OP}}
"""Operator domains an artifact may use, and (None: any) which ops of each."""
NBITS = (2, 4, 8)
PERM_TYPES: dict[int, str] = {onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT64: "int64"}
"""Index types of an act-order ``perm`` initializer (``Gather``'s)."""


def attr_ints(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: int(a.i) for a in node.attribute if a.type == onnx.AttributeProto.INT}


def dims_of(f: OnnxFile, name: str) -> tuple[int, ...] | None:
    t = f.initializers.get(name)
    return None if t is None else tuple(int(d) for d in t.dims)


def fail(node: onnx.NodeProto, field: str, message: str, expected: object, found: object) -> ArtifactError:
    return ArtifactError(message, file=CURRENT[0], tensor=node.name, field=field, expected=expected, found=found)


CURRENT = [MODEL_FILE]
"""The model file the node gates are checking (for messages)."""


def check_nbits(f: OnnxFile, node: onnx.NodeProto) -> None:
    a = attr_ints(node)
    k, n, bits, block = a.get("K", 0), a.get("N", 0), a.get("bits", 4), a.get("block_size", 0)
    if bits not in NBITS:
        raise fail(node, "bits", "MatMulNBits runs 2, 4 or 8 bits on CPU", "2 | 4 | 8", bits)
    if block < 16 or block & (block - 1):
        raise fail(node, "block_size", "must be a power of two >= 16", ">= 16, power of two", block)
    if k <= 0 or n <= 0:
        raise fail(node, "K/N", "must be positive", "> 0", (k, n))
    k_blocks = -(-k // block)
    want = {
        1: (n, k_blocks, block * bits // 8),
        2: (n, k_blocks),
        3: (n, -(-k_blocks * bits // 8)),
    }
    for i, shape in want.items():
        if i >= len(node.input) or not node.input[i]:
            if i < 3:
                raise fail(node, f"input {i}", "missing", "an initializer", "none")
            continue
        found = dims_of(f, node.input[i])
        if found != shape and not (i == 2 and found == (n * k_blocks,)):
            raise fail(
                node, f"input {i} ({node.input[i]})", "shape disagrees with K, N, bits and block_size", shape, found
            )


def check_perm(f: OnnxFile, made_by: dict[str, onnx.NodeProto], node: onnx.NodeProto, k: int) -> None:
    """When ``node``'s input is an act-order ``Gather`` of an initializer, that ``perm`` is ``[k]`` of
    an index type, gathered along the last axis."""
    g = made_by.get(node.input[0]) if node.input else None
    if g is None or g.op_type != "Gather" or len(g.input) != 2 or g.input[1] not in f.initializers:
        return
    perm = f.initializers[g.input[1]]
    axis = next((int(a.i) for a in g.attribute if a.name == "axis"), 0)
    if axis != -1:
        raise fail(g, "axis", f"an act-order input of {node.name} is gathered along its last axis", -1, axis)
    dims = [int(d) for d in perm.dims]
    if dims != [k] or perm.data_type not in PERM_TYPES:
        found = f"{dims} {PERM_TYPES.get(perm.data_type, f'data_type {perm.data_type}')}"
        raise fail(g, f"input 1 ({g.input[1]})", "an act-order perm holds K indices", f"[{k}] int32 | int64", found)


def check_matmul(f: OnnxFile, made_by: dict[str, onnx.NodeProto], node: onnx.NodeProto) -> None:
    """A ``MatMul`` of a ``DequantizeLinear`` weight ``[K, N]``: its act-order input, if any (``check_perm``)."""
    w = made_by.get(node.input[1]) if len(node.input) == 2 else None
    kn = dims_of(f, w.input[0]) if w is not None and w.op_type == "DequantizeLinear" and w.input else None
    if kn is not None and len(kn) == 2:
        check_perm(f, made_by, node, kn[0])


def check_dq(f: OnnxFile, node: onnx.NodeProto) -> None:
    a = attr_ints(node)
    block = a.get("block_size", 0)
    x = dims_of(f, node.input[0])
    if not block or x is None:
        return
    axis = a.get("axis", 1) % len(x)
    want = tuple(-(-d // block) if i == axis else d for i, d in enumerate(x))
    for i in (1, 2):
        if i < len(node.input) and node.input[i]:
            found = dims_of(f, node.input[i])
            if found != want:
                raise fail(node, f"input {i} ({node.input[i]})", "blocked qparam shape", want, found)


def check_gqa(node: onnx.NodeProto) -> None:
    """A ``GroupQueryAttention`` as ``gqa.py`` writes it: only its attributes, heads that group
    (``num_heads`` a multiple of ``kv_num_heads``), no rotary of its own (the graph rotates), a window
    of -1 or > 0, a soft cap >= 0, and its three outputs."""
    unknown = sorted(a.name for a in node.attribute if a.name not in gqa.ATTRIBUTES)
    if unknown:
        raise fail(node, unknown[0], "GroupQueryAttention attribute not written by qcompiler", gqa.ATTRIBUTES, unknown)
    a = attr_ints(node)
    heads, kv_heads = a.get("num_heads", 0), a.get("kv_num_heads", 0)
    if heads <= 0:
        raise fail(node, "num_heads", "must be positive", "> 0", heads)
    if kv_heads <= 0 or heads % kv_heads:
        raise fail(node, "kv_num_heads", f"must divide num_heads ({heads})", f"a divisor of {heads}", kv_heads)
    if a.get("do_rotary", 0) != 0:
        raise fail(node, "do_rotary", "the graph applies the rotary embedding itself", 0, a["do_rotary"])
    window = a.get("local_window_size", -1)
    if window == 0 or window < -1:
        raise fail(node, "local_window_size", "no window is -1, a window is > 0", "-1 | > 0", window)
    cap = next((float(x.f) for x in node.attribute if x.name == "softcap"), 0.0)
    if not cap >= 0.0:
        raise fail(node, "softcap", "must be >= 0 (0: none)", ">= 0", cap)
    if len(node.output) != 3:
        raise fail(node, "output", "output, present key, present value", 3, len(node.output))


def check_nbits_node(f: OnnxFile, made_by: dict[str, onnx.NodeProto], node: onnx.NodeProto) -> None:
    check_nbits(f, node)
    check_perm(f, made_by, node, attr_ints(node).get("K", 0))


NodeCheck = Callable[[OnnxFile, dict[str, onnx.NodeProto], onnx.NodeProto], None]
NODE_CHECKS: dict[str, NodeCheck] = {
    "MatMulNBits": check_nbits_node,
    gqa.OP: lambda f, made_by, node: check_gqa(node),
    "DequantizeLinear": lambda f, made_by, node: check_dq(f, node),
    "MatMul": check_matmul,
}
"""op_type -> the check gate 3 runs on each such node (its file, the node producing each value, the node)."""


def check_nodes(f: OnnxFile) -> None:
    made_by = {o: n for n in f.model.graph.node for o in n.output}
    for node in f.model.graph.node:
        if node.domain not in ALLOWED_DOMAINS:
            raise fail(node, "domain", "operator domain not allowed", " | ".join(ALLOWED_DOMAINS), node.domain)
        allowed = ALLOWED_DOMAINS[node.domain]
        if allowed is not None and node.op_type not in allowed:
            raise fail(node, "op_type", f"not allowed in domain {node.domain}", " | ".join(allowed), node.op_type)
        check = NODE_CHECKS.get(node.op_type)
        if check is not None:
            check(f, made_by, node)


def check_model_file(root: Path, name: str) -> OnnxFile:
    """Gates 1-3 for one model file."""
    try:
        f = open_onnx(root / name)
    except ArtifactError:
        raise
    except QcError as e:
        raise ArtifactError(str(e), file=name) from None
    try:
        onnx.checker.check_model(str(root / name), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ArtifactError(f"onnx.checker: {first_line(e)}", file=name) from None
    except Exception as e:  # the checker's input is the file: what else it raises (a UnicodeDecodeError ...) is its
        raise ArtifactError(f"onnx.checker failed ({type(e).__name__}): {first_line(e)}", file=name) from None
    CURRENT[0] = name
    try:
        check_nodes(f)
    finally:
        CURRENT[0] = MODEL_FILE
    return f


def first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


def open_onnx_dir(
    root: Path, manifest: dict[str, Any] | None, form: str | None = None, accuracy: int | None = None
) -> OpenedArtifact:
    """Gates 1-6 (module docstring) on an ONNX artifact; ``form``: the one the target implies;
    ``accuracy``: the level emit wrote with (its reopen, before the manifest records it)."""
    models = {MODEL_FILE: check_model_file(root, MODEL_FILE)}
    no_cache = (root / NO_CACHE_FILE).exists() or (root / NO_CACHE_FILE).is_symlink()
    if no_cache:
        models[NO_CACHE_FILE] = check_model_file(root, NO_CACHE_FILE)
    module = read_graph(root)
    gates = ["container", "checker", "nodes", "graph"]
    if manifest is not None:
        options = emit_options(manifest, form)
        accuracy = options.accuracy
        check_binding(root, module, options, no_cache)
        gates.append("binding")
    runtime: set[str] = set()
    config: Any = None
    if accuracy is not None:
        decoder = models.get(DECODER_FILE)
        runtime, config = check_package(root, module, decoder and decoder.model, accuracy)
        gates.append("package")
    entries = [
        ContainerEntry(t.name, MODEL_FILE, onnx.TensorProto.DataType.Name(t.data_type), tuple(t.dims), 0)
        for t in models[MODEL_FILE].model.graph.initializer
    ]
    target = str((manifest or {}).get("target", "onnx"))
    files = {MODEL_FILE, DATA_FILE, "graph.qir", *([NO_CACHE_FILE] if no_cache else []), *runtime}
    return OpenedArtifact(root, target, manifest, module, entries, gates, config or {}, files=files)
