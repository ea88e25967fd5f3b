"""The consumer view of ``bench/fuzz.py``: what a consumer of an artifact sees, per path, so that an
accepted case can be told a no-op (``accepted-unchanged``) from accepted corruption
(``accepted-changed``). JSON files count as their canonical parsed JSON, ``graph.qir`` as its
canonical printed module (order without meaning removed), GGUF and safetensors as their key-values
or metadata and each tensor's name, type, shape and bytes (where a tensor sits is not seen), ONNX as
its protobuf reserialized; any other file, or one that does not parse, as its bytes. ``IGNORED`` is
the one table of what the view leaves out, with why.

``graph.qir`` has one consumer, qcompiler itself (the reference interpreter and the runtime), so
when it is the only file whose text changed, ``behaviour`` decides: the reference graph's outputs
and the loaded runtime's outputs on fixed token inputs (other inputs than verify's probe), each within
``NOISE`` (relative L2 1e-6, the float32 noise between machines; 10 times below the probe's
tolerance). A textual edit that computes the same (an axis written -1 or 3 on a rank-4 tensor, a
label, every rotary position shifted by one constant) is then a no-op; one that computes anything
else is accepted corruption.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any

from fuzz_formats import parse_gguf
from fuzz_mutators import MANIFEST

IGNORED: list[tuple[str, str, str]] = [
    ("manifest.json", "files", "the file list: the files gate checks it against the directory"),
    ("manifest.json", "self_sha256", "the manifest's digest of itself: the manifest gate checks it"),
    ("manifest.json", "provenance.calibration", "free-text provenance: only a signature protects it"),
    ("manifest.json", "provenance.converter", "free-text provenance (name, version, git commit): only a signature"),
    ("manifest.json", "provenance.ir", "free-text capture provenance (library versions, scheme): only a signature"),
    ("manifest.json", "provenance.pipeline", "the pass pipeline as text, a record: only a signature protects it"),
    ("manifest.json", "provenance.source", "the source spec as text, a record: only a signature protects it"),
    ("manifest.json", "provenance.source_sha256", "hash of source weights nobody has at load: only a signature"),
    ("manifest.json", "model.revision", "free-text revision of the source: only a signature protects it"),
    ("manifest.json", "model.architecture", "a label from the source config; config.json/metadata (bound) is read"),
    ("manifest.json", "model.model_type", "a label from the source config; config.json/metadata (bound) is read"),
    ("manifest.json", "versions.tested_runtime", "the peer versions it was tested with, for people: descriptive"),
    ("manifest.json", "versions.triton", "the Triton of the AOT evidence: graph.qir's record binds the evidence"),
    ("manifest.json", "rate_ledger", "bits-per-weight statistics for people; no reader or runtime reads them"),
    ("manifest.json", "parity.ok", "compile-time result; verify recomputes every rung from the artifact's bytes"),
    ("manifest.json", "parity.failures", "compile-time result; verify recomputes every rung"),
    ("manifest.json", "parity.rung1_pack_unpack", "compile-time counts; verify recomputes rung 1"),
    ("manifest.json", "parity.rung2_reconstruction.bit_exact", "compile-time count; verify recomputes rung 2"),
    ("manifest.json", "parity.rung2_reconstruction.reference", "a label for people"),
    ("manifest.json", "parity.rung2_reconstruction.weights", "compile-time count; verify recomputes rung 2"),
    ("manifest.json", "parity.rung3_operators", "compile-time metrics; verify recomputes rung 3"),
    ("manifest.json", "parity.graph_probe.projections", "measured; verify re-measures, accepts within its tolerance"),
    ("manifest.json", "parity.graph_probe.norm", "measured; verify re-measures, accepts within its tolerance"),
    ("manifest.json", "parity.graph_probe.tolerance", "a label: verify uses its own PROBE_TOLERANCE"),
    ("manifest.json", "parity.graph_probe.inputs", "a label naming the probe input: verify uses its own"),
    ("manifest.sig", "*", "detached signature: checked against a trusted key only (verify --trusted-key)"),
    ("graph.qir", "module attribute provenance", "free-text capture provenance, as in the manifest"),
    ("model.gguf", "kv general.name", "a display name; llama.cpp and our runtime never interpret it"),
    ("*.onnx", "producer_name, producer_version, doc_string, node names", "labels; onnxruntime computes without"),
    ("*", "empty directories", "hold no bytes; no reader or runtime looks at a directory without files"),
]
"""The one table of what the consumer view leaves out, each with the reason no consumer is hurt by a change."""


KNOWN: dict[tuple[str, str], str] = {}
"""(path, raw sha256) -> canonical digest, filled by the base artifacts' views: a file a case left
byte-identical is not parsed again."""


def view(root: Path, remember: bool = False) -> dict[str, str]:
    """What a consumer sees, per path: its kind and a digest of its canonical content (see ``IGNORED``).
    ``remember``: a base artifact's view, kept in ``KNOWN``."""
    out: dict[str, str] = {}
    for dirpath, dirnames, names in os.walk(root):
        for name in sorted(names + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel == "manifest.sig":
                continue
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = f"link -> {os.readlink(p)}"
            elif not stat.S_ISREG(st.st_mode):
                out[rel] = f"special {stat.S_IFMT(st.st_mode):o}"
            else:
                data = p.read_bytes()
                raw = (rel, hashlib.sha256(data).hexdigest())
                digest = KNOWN.get(raw) or hashlib.sha256(canonical(rel, data)).hexdigest()
                if remember:
                    KNOWN[raw] = digest
                out[rel] = digest if st.st_nlink == 1 else f"hard link {digest}"
    return out


def diff(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def canonical(rel: str, data: bytes) -> bytes:
    try:
        if rel == MANIFEST:
            return canonical_manifest(json.loads(data))
        if rel.endswith(".json"):
            return json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
        if rel == "graph.qir":
            return canonical_graph(data.decode())
        if rel.endswith(".gguf"):
            return canonical_gguf(data)
        if rel.endswith(".safetensors"):
            return canonical_safetensors(data)
        if rel.endswith(".onnx"):
            return canonical_onnx(data)
    except Exception:
        return data
    return data


def canonical_gguf(data: bytes) -> bytes:
    """Key-values sorted by key (``general.name`` and a default ``general.alignment`` left out), and
    each tensor as name -> (ne without trailing 1s, as ggml pads them; type; sha256 of its bytes)."""
    from qcompiler.backends.gguf.ggml_types import BLOCKS, GGMLType

    g, _ = parse_gguf(data)
    default = (b"general.alignment", struct.pack("<I", 32))
    kvs = sorted((kv.key.hex(), kv.vtype, kv.raw.hex()) for kv in g.kvs if kv.key != b"general.name")
    kvs = [kv for kv in kvs if (bytes.fromhex(kv[0]), bytes.fromhex(kv[2])) != default]
    tensors: dict[str, Any] = {}
    for t in g.infos:
        block, size = BLOCKS[GGMLType(t.gtype)]
        nbytes = math.prod(t.ne) // block * size
        ne = list(t.ne)
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        body = g.data[t.offset : t.offset + nbytes]
        tensors[t.name.hex()] = [ne, t.gtype, hashlib.sha256(body).hexdigest(), len(body)]
    return json.dumps({"kv": kvs, "tensors": tensors, "version": g.version}, sort_keys=True).encode()


def canonical_safetensors(data: bytes) -> bytes:
    """``__metadata__`` and each tensor as name -> (dtype, shape, sha256 of its bytes): header
    whitespace, key order and where in the buffer a tensor sits are no part of what a reader gets."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    buffer = data[8 + n :]
    out: dict[str, Any] = {"__metadata__": header.pop("__metadata__", None)}
    for name, e in header.items():
        b, end = e["data_offsets"]
        body = buffer[b:end]
        out[name] = [e["dtype"], e["shape"], hashlib.sha256(body).hexdigest(), len(body)]
    return json.dumps(out, sort_keys=True).encode()


def canonical_manifest(doc: Any) -> bytes:
    if isinstance(doc, dict):
        for file, path, _ in IGNORED:
            if file == MANIFEST:
                drop(doc, path.split("."))  # pyright: ignore[reportUnknownArgumentType]
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def drop(doc: dict[str, Any], path: list[str]) -> None:
    if len(path) == 1:
        doc.pop(path[0], None)
    elif isinstance(doc.get(path[0]), dict):
        drop(doc[path[0]], path[1:])


def canonical_graph(text: str) -> bytes:
    from qcompiler.ir.parser import parse_module
    from qcompiler.ir.printer import print_module

    m = parse_module(text, "graph.qir")
    m.attrs.pop("provenance", None)
    return canonical_order(print_module(m)).encode()


_DEF = re.compile(r"^\s*(%[\w.]+)\s*=")
_USE = re.compile(r"%[\w.]+")


def canonical_order(text: str) -> str:
    """Printed IR with order that carries no meaning removed: each run of tensor declarations sorted,
    each run of ops in the smallest topological order (an op moved past one it does not depend on
    computes the same)."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        j, kind = i, line_class(lines[i])
        while j < len(lines) and kind and line_class(lines[j]) == kind:
            j += 1
        if not kind:
            out.append(lines[i])
            i += 1
            continue
        out += sorted(lines[i:j]) if kind == "tensor" else topological(lines[i:j])
        i = j
    return "\n".join(out)


def line_class(line: str) -> str:
    s = line.lstrip()
    return "tensor" if s.startswith("tensor @") else "op" if _DEF.match(line) else ""


def topological(run: list[str]) -> list[str]:
    defined = {m.group(1): k for k, line in enumerate(run) if (m := _DEF.match(line))}
    deps = [uses(line, defined) - {k} for k, line in enumerate(run)]
    deps = [
        {defined[u] for u in _USE.findall(line.partition("=")[2]) if u in defined} - {k} for k, line in enumerate(run)
    ]
    users: dict[int, list[int]] = {}
    for k, ds in enumerate(deps):
        for d in ds:
            users.setdefault(d, []).append(k)
    waiting = [len(ds) for ds in deps]
    ready = [(run[k], k) for k in range(len(run)) if not waiting[k]]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        line, k = heapq.heappop(ready)
        order.append(line)
        for u in users.get(k, []):
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (run[u], u))
    return order if len(order) == len(run) else run


def canonical_onnx(data: bytes) -> bytes:
    import onnx

    model = onnx.load_model_from_string(data)
    model.producer_name = model.producer_version = model.doc_string = ""
    model.graph.doc_string = ""
    for node in model.graph.node:
        node.name = node.doc_string = ""
    return model.SerializeToString(deterministic=True)


def uses(line: str, defined: dict[str, int]) -> set[int]:
    return {defined[u] for u in _USE.findall(line.partition("=")[2]) if u in defined}


BEHAVIOUR_IDS = [[11, 2, 7, 3, 5, 13, 1], [2, 11, 5, 13, 3, 7, 0]]


NOISE = 1e-6
"""Relative L2 change of an output below which an edit computes the same: float32 arithmetic of one
graph differs by this much between machines, and so can an exact identity rewritten (shifting every
rotary position by a constant, which attention cannot see, moves the logits by about 1e-7)."""


def behaviour(root: Path) -> list[Any] | str:
    """What qcompiler computes with the artifact at ``root`` (see the module docstring): the reference
    graph's outputs, then the loaded runtime's, as float64 numpy arrays."""
    from qcompiler.artifact.evidence import probe_inputs
    from qcompiler.ir.interpret import run_graph
    from qcompiler.ir.parser import parse_module
    from qcompiler.runtime import Session, load

    m = parse_module((root / "graph.qir").read_text(), "graph.qir")
    m.base_dir = str(root)
    inputs = probe_inputs(m, BEHAVIOUR_IDS)
    if inputs is None:
        return "no token inputs"
    outs = [*run_graph(m, inputs), *Session(load(root)).run(inputs)]
    return [o.detach().double().contiguous().numpy() for o in outs]


def same_behaviour(a: list[Any] | str, b: list[Any] | str) -> bool:
    """Whether two ``behaviour`` results agree: the same outputs, shapes and non-finite positions,
    and each output within ``NOISE`` (relative L2) of the other."""
    import numpy as np

    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        finite = np.isfinite(x)
        if x.shape != y.shape or not np.array_equal(finite, np.isfinite(y)):
            return False
        if not np.array_equal(x[~finite], y[~finite], equal_nan=True):
            return False
        scale = max(float(np.linalg.norm(x[finite])), 1e-30)
        if not float(np.linalg.norm(x[finite] - y[finite])) <= NOISE * scale:
            return False
    return True
