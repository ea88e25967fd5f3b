"""Write a GGUF artifact: ``model.gguf`` (what llama.cpp loads, alone), ``graph.qir`` (its tensors
point into the GGUF's blocks; its ``bound.gguf`` record holds the sha256 of every metadata value, as
read back from the written file), ``graph.safetensors`` (graph-only tensors llama.cpp does not
read), and ``manifest.json`` last.

Each quantized weight's block bytes are joined from its IR parts (codes in the ``ggml``/``ggml-k`` code
layout, f16 scales) by the type's codec, and split back to prove the blocks hold the parts, when the
file is written: one tensor's bytes are held at a time, not the model's. Codes in the type's own code
layout are its blocks' code bytes already: they are copied into the blocks (``join_packed``), not
unpacked and packed again; codes in any other layout are unpacked and packed by the codec's ``join``. llama's
``q_proj``/``k_proj`` rows (codes, scales, biases) are permuted for ggml's RoPE: a pure reordering; a
float ``Conv1D`` weight (``[K, N]`` in the source, ``plan.transposed_dense``) is written transposed.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from qcompiler.artifact.publish import EmitError, Finish, finish, relocated
from qcompiler.artifact.request import ArtifactRequest
from qcompiler.artifact.writer import ArtifactWriter
from qcompiler.backends.gguf.archs import Arch, arch_for, refusal
from qcompiler.backends.gguf.archs_moe import expert_metadata, row_vector, stacked
from qcompiler.backends.gguf.blobs import opened
from qcompiler.backends.gguf.codecs import Codec, get_codec, row_slices
from qcompiler.backends.gguf.ggml_types import GGMLType, row_bytes
from qcompiler.backends.gguf.plan import (
    ENCODING_TYPE,
    GGUF_FILE,
    GRAPH_FILE,
    NEGATED_MIN,
    NESTED_PARTS,
    GgufWeight,
    container_tensors,
    gguf_weights,
    transposed_dense,
)
from qcompiler.backends.gguf.read import RECORD, metadata_digests, open_gguf_dir
from qcompiler.backends.gguf.rope_freqs import TENSOR as ROPE_FREQS
from qcompiler.backends.gguf.rope_freqs import rope_freqs
from qcompiler.backends.gguf.tokenizer import tokenizer_metadata
from qcompiler.backends.gguf.writer import KV, TensorPayload, serialize
from qcompiler.backends.safetensors.blobs import METADATA
from qcompiler.backends.safetensors.container_write import TensorBytes
from qcompiler.backends.safetensors.container_write import serialize as serialize_st
from qcompiler.backends.safetensors.plan import ST_DTYPE
from qcompiler.errors import UsageError
from qcompiler.ir.blobs import byte_view, read_array, read_blob, read_float32
from qcompiler.ir.core import Module
from qcompiler.ir.facts import with_record
from qcompiler.ir.layouts import logical_view
from qcompiler.ir.printer import print_module

TESTED_RUNTIMES = {"llama-cpp-python": "0.3.36", "gguf": "0.19.0"}


def rows(arr: np.ndarray, perm: np.ndarray | None) -> np.ndarray:
    return arr if perm is None else arr[perm]


def packed_codes(w: GgufWeight, gt: GGMLType) -> bool:
    """Whether the weight's codes are already ``gt``'s code bytes: the ``ggml``/``ggml-k`` layout of its
    encoding (what ``pack-layouts`` gives a weight the gguf target holds exactly)."""
    return w.t.pack.family in ("ggml", "ggml-k") and ENCODING_TYPE.get(w.t.pack.encoding) == gt


def quantized_parts(m: Module, w: GgufWeight, gt: GGMLType) -> dict[str, np.ndarray]:
    """The weight's codec parts from its IR tensors: codes as ``gt``'s packed code bytes when the IR
    holds them so (``packed_codes``), else unpacked to the logical layout (a weight in another layout:
    its codes must be re-packed by the codec)."""
    parts = {NESTED_PARTS.get(path, path): read_array(m, name) for path, name in w.refs.items()}
    if not packed_codes(w, gt):
        parts["codes"], _ = logical_view(parts["codes"], w.t, parts)
    if w.t.pack.encoding in NEGATED_MIN:
        parts["min"] = -parts["min"]
    return parts


def joined(codec: type[Codec], parts: dict[str, np.ndarray], packed: bool) -> tuple[np.ndarray, str | None]:
    """A slice of rows' block bytes, and the first part that does not split back from them (or None).
    Packed codes go into the blocks as they are (``join_packed``; the proof: the qparams split back and
    the code bytes are the ones given, in the canonical form ``join`` would write); logical codes are
    packed by ``join``, and ``split(join(parts)) == parts``."""
    if packed:
        qparams = {k: v for k, v in parts.items() if k != "codes"}
        blob = codec.join_packed(parts["codes"], qparams)
        code, again = codec.split_packed(blob)
        if not np.array_equal(code, codec.canonical_code_bytes(parts["codes"])):
            return blob, "codes"
    else:
        blob = codec.join(parts)
        again = codec.split(blob)
    for name, v in again.items():
        if not np.array_equal(v.view(np.uint8), parts[name].view(np.uint8)):
            return blob, name
    return blob, None


def quantized_payload(m: Module, w: GgufWeight, gt: GGMLType, perm: np.ndarray | None) -> memoryview:
    """The weight's block bytes, joined a slice of rows at a time, each slice split back to prove the
    parts are what the blocks hold (memory: the weight's parts and one slice, not a second copy)."""
    codec, packed = get_codec(gt), packed_codes(w, gt)
    whole = {k: rows(v, perm) for k, v in quantized_parts(m, w, gt).items()}
    n, k = (int(d) for d in w.t.shape)
    width = row_bytes(gt, k)
    dtypes = {p.name: np.dtype(p.dtype) for p in codec.parts} | ({"codes": np.dtype(np.uint8)} if packed else {})
    out = bytearray(n * width)
    for r0, r1 in row_slices(n, k):
        parts = {name: np.ascontiguousarray(whole[name][r0:r1]).astype(dt, copy=False) for name, dt in dtypes.items()}
        blob, bad = joined(codec, parts, packed)
        if bad is not None:
            how = "split_packed(join_packed(parts))" if packed else "split(join(parts))"
            raise EmitError(f"{w.hf}: {how} != parts for {gt.name} (part {bad!r}, rows from {r0})")
        out[r0 * width : r0 * width + blob.nbytes] = blob.tobytes()
    return memoryview(out)


def dense_narrow(m: Module, name: str, gt: GGMLType) -> str:
    """The ``~dtype`` suffix that narrows a dense tensor written as ``gt`` back to its IR dtype."""
    ir = m.tensors[name].blob.dtype.name
    return f"~{ir}" if gt == GGMLType.F32 and ir != "f32" else ""


def dense_payload(
    m: Module, name: str, gt: GGMLType, perm: np.ndarray | None, shift: bool = False, flip: bool = False
) -> memoryview:
    """The tensor's bytes in ``gt`` (1-D widened to F32; ``dense_narrow`` says how to read it back);
    ``shift``: ``1 + w`` in float32, as the model computes it (Gemma's norms, ``archs.Arch.shifted``);
    transposed when ``flip`` (a ``[K, N]`` source weight ggml wants as ``[N, K]`` rows). A view of the
    values read, not a copy, when nothing moves them (a 128256-row embedding: 1 GB less at its peak)."""
    if shift:
        return byte_view(shifted_values(m, name))
    arr = read_float32(m, name).astype("<f4") if dense_narrow(m, name, gt) else read_array(m, name)
    return byte_view(rows(arr.T if flip else arr, perm))


def shifted_values(m: Module, name: str) -> np.ndarray:
    """``1 + w`` in float32 for a dense tensor the GGUF holds shifted; the reader's ``!sub1`` gives
    ``w`` back only when the sum was exact, so an inexact one (``|w|`` below about 2**-23 of 1) is
    refused here, naming the element, rather than published as another weight."""
    w = read_float32(m, name).astype("<f4")
    v = w + np.float32(1.0)
    back = v - np.float32(1.0)
    if not np.array_equal(back.view(np.uint32), w.view(np.uint32)):
        i = int(np.argmax(back.view(np.uint32) != w.view(np.uint32)))
        raise EmitError(
            f"{name}: llama.cpp's graph reads this norm as 1 + w, and 1 + w[{i}] = 1 + {float(w.flat[i])!r} "
            "is not exact in float32, so the GGUF could not give this weight back"
        )
    return v


def payload_size(shape: tuple[int, ...], gt: GGMLType) -> int:
    return int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(gt, shape[-1])


def metadata(
    arch: Arch, config: dict[str, Any], files: dict[str, bytes], quantized: bool, carried: list[KV] | None = None
) -> list[KV]:
    """The file's metadata. ``carried`` (a GGUF source's tokenizer keys) replaces keys of the same name
    and supplies the tokenizer, which is then not rebuilt from files."""
    kvs = [
        KV.string("general.architecture", arch.name),
        KV.string("general.name", str(config.get("_name_or_path") or config.get("model_type") or arch.name)),
        KV.u32("general.alignment", 32),
    ]
    if quantized:
        kvs.append(KV.u32("general.quantization_version", 2))
    if carried:
        by_key = {kv.key: kv for kv in carried}
        ours = [by_key.pop(kv.key, kv) for kv in kvs + arch.metadata(config, files)]
        return ours + list(by_key.values())
    return kvs + arch.metadata(config, files) + tokenizer_metadata(files, config, arch.name)


def emit(m: Module, req: ArtifactRequest) -> Path:
    src = req.source
    config = (src.config if src else None) or {}
    arch = arch_for(config)
    why = refusal(config)
    if arch is None or why:
        raise UsageError(why)
    weights = gguf_weights(m)
    flipped = transposed_dense(m)  # Conv1D weights: [K, N] in the IR, [N, K] rows in the GGUF
    by_owner = {o: w for w in weights.values() for o in w.refs.values()}
    payloads: list[TensorPayload] = []
    graph_tensors: list[TensorBytes] = []
    locations: dict[str, str] = {}
    stored: dict[str, int] = {}
    for ct in container_tensors(m, arch):
        owner = ct.owners[0]
        if ct.file == "graph":
            graph_tensors.append(
                TensorBytes(owner, ST_DTYPE[ct.dtype], ct.shape, read_blob(m.tensors[owner], m.base_dir))
            )
            locations[owner] = f"safetensors:{GRAPH_FILE}#{owner}"
            continue
        w = by_owner.get(owner)
        hf = w.hf if w is not None else owner
        if arch.gguf_name(hf) is None:
            raise EmitError(f"{hf}: llama.cpp's {arch.name} graph has no tensor for it")
        gt = GGMLType[ct.dtype.upper()]
        perm = arch.row_permutation(hf, config, ct.shape[0])
        heads = f"!qk={qk_heads(hf, config)}" if perm is not None else ""
        size = payload_size(ct.shape, gt)
        if w is not None and gt not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            data = functools.partial(quantized_payload, m, w, gt, perm)  # made when written: one at a time
            for path, name in w.refs.items():
                neg = "!neg" if path == "min" and w.t.pack.encoding in NEGATED_MIN else ""
                locations[name] = f"gguf:{GGUF_FILE}#{ct.name}@{NESTED_PARTS.get(path, path)}{neg}{heads}"
            stored[w.hf] = size
        else:
            shift, flip, row = arch.is_shifted(hf), owner in flipped, row_vector(ct.name, ct.shape)
            data = functools.partial(dense_payload, m, owner, gt, perm, shift, flip)
            narrow = dense_narrow(m, owner, GGMLType.F32 if shift else gt)
            t = "!sub1" if shift else "!t" if flip else "!row" if row else ""
            locations[owner] = f"gguf:{GGUF_FILE}#{ct.name}@values{t}{heads}{narrow}"
        shape = ct.shape[1:] if w is None and row_vector(ct.name, ct.shape) else ct.shape
        payloads.append(TensorPayload(ct.name, shape, int(gt), data, size))
    payloads = stack_experts(payloads)
    factors = rope_freqs(m, arch, config)
    if factors is not None:  # Llama 3's scaled RoPE: derived from the graph's inv_freq, bound by the record
        payloads.append(TensorPayload(ROPE_FREQS, factors.shape, int(GGMLType.F32), factors.tobytes(), factors.nbytes))
    check_inventory(arch, config, payloads)
    carried = src.metadata.get("gguf") if src else None
    kvs = metadata(arch, config, src.files if src else {}, bool(weights), carried)
    graph = relocated(m, locations)
    all_params = sum(int(np.prod(p.shape)) for p in payloads)
    with ArtifactWriter(req.out, fail_at=req.fail_at, force=req.force) as w:
        w.write_file(GGUF_FILE, serialize(kvs, payloads))
        if graph_tensors:
            w.write_file(GRAPH_FILE, serialize_st(graph_tensors, METADATA))
        record = {RECORD: metadata_digests(opened(w.tmp, GGUF_FILE))}
        w.write_file("graph.qir", print_module(with_record(graph, record)).encode())
        finish(
            w,
            m,
            req,
            Finish(
                target="gguf",
                reopen=lambda path: open_gguf_dir(path, None),
                container="gguf/3",
                versions={"tested_runtime": TESTED_RUNTIMES, "gguf_architecture": arch.name},
                topology={"file_shards": 1},
                stored=stored,
                all_params=all_params,
            ),
        )
    return req.out


def qk_heads(hf: str, config: dict[str, Any]) -> int:
    if ".k_proj." in hf:
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return int(config["num_attention_heads"])


def stack_experts(payloads: list[TensorPayload]) -> list[TensorPayload]:
    """Each MoE projection's per-expert slabs (``NAME[e]``, ``archs_moe.STACKED``) joined, in expert order,
    into the one 3-D tensor ``NAME`` llama.cpp reads, at the first slab's place. Every slab has one
    ggml type and shape, and the indices are 0..E-1: a stack of blocks, each expert's bytes as they are."""
    slabs: dict[str, dict[int, TensorPayload]] = {}
    for p in payloads:
        base, e = stacked(p.name)
        if e is not None:
            slabs.setdefault(base, {})[e] = p
    out: list[TensorPayload] = []
    for p in payloads:
        base, e = stacked(p.name)
        if e is None:
            out.append(p)
            continue
        parts = slabs.pop(base, None)
        if parts is None:
            continue  # joined at its first slab
        ordered = [parts[i] for i in sorted(parts)]
        kinds = {(q.type_id, q.shape) for q in ordered}
        if sorted(parts) != list(range(len(parts))) or len(kinds) != 1:
            raise EmitError(
                f"{base}: llama.cpp stacks experts 0..E-1 of one type and shape "
                f"(found experts {sorted(parts)}, types and shapes {sorted(kinds)})"
            )
        data = functools.partial(joined_slabs, ordered)
        size = sum(q.nbytes for q in ordered)
        out.append(TensorPayload(base, (len(ordered), *ordered[0].shape), ordered[0].type_id, data, size))
    return out


def joined_slabs(slabs: list[TensorPayload]) -> bytes:
    return b"".join(bytes(q.data() if callable(q.data) else q.data) for q in slabs)


def check_inventory(arch: Arch, config: dict[str, Any], payloads: list[TensorPayload]) -> None:
    from qcompiler.backends.gguf.tensor_tables import expected_tensors

    layers = int(config.get("num_hidden_layers") or config["n_layer"])  # GPT-2: n_layer
    want = expected_tensors(arch.name, layers, bool(expert_metadata(arch.name, config)))
    have = {p.name: p for p in payloads}
    missing = sorted(n for n, required in want.items() if required and n not in have)
    extra = sorted(n for n in have if n not in want)
    if missing:
        raise EmitError(
            f"llama.cpp's {arch.name} graph needs {missing[0]!r} (and {len(missing) - 1} more), which the module lacks"
        )
    if extra:
        raise EmitError(f"{extra[0]!r} is not a tensor of llama.cpp's {arch.name} graph (it would refuse to load)")
