"""Write a ``triton`` artifact: the weights, the generated kernels, the graph; manifest last.

Files:

- ``model.safetensors``: every tensor of the module under its tensor-table name, quantized codes in
  the ``triton-kn`` layout, qparams as the IR holds them;
- ``kernels/<id>.py``: one generated module per kernel key the graph needs (the key's kind's
  ``generate``, ``kinds.KINDS``: ``codegen`` for affine / float8 weights, ``mixprec_codegen`` for mixprec);
- ``kernels/index.json``: per kernel its id, kind, key (the admission signature it accepts), source file
  and sha256, launch configuration, the weights that use it, and the AOT compile evidence (sm_80, sm_90);
- ``graph.qir`` (its tensors point into ``model.safetensors``; its ``bound.kernels`` record holds the
  sha256 of the index's ``triton`` version, ``targets`` and each kernel's AOT evidence), and
  ``manifest.json`` last, whose
  ``versions.required_kernels`` lists the kernel ids.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import triton

from qcompiler.artifact.publish import EmitError, Finish, finish, relocated
from qcompiler.artifact.request import ArtifactRequest
from qcompiler.artifact.writer import ArtifactWriter
from qcompiler.backends.safetensors.blobs import METADATA
from qcompiler.backends.safetensors.container_write import TensorBytes, serialize
from qcompiler.backends.safetensors.plan import ST_DTYPE
from qcompiler.backends.triton.aot import TARGETS
from qcompiler.backends.triton.codegen import CODEGEN_VERSION, TL_DTYPE, source_sha256
from qcompiler.backends.triton.kinds import kind_of
from qcompiler.backends.triton.plan import INDEX_FILE, KERNEL_DIR, MODEL_FILE, module_kernels
from qcompiler.backends.triton.runtime import MIN_CAPABILITY
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_blob
from qcompiler.ir.core import Module
from qcompiler.ir.facts import with_record
from qcompiler.ir.ops.quant import weight_name
from qcompiler.ir.printer import print_module


def kernel_entry(key: Any, source: str, weights: list[str], aot: bool) -> dict[str, Any]:
    kind = kind_of(key)
    return {
        "id": key.id,
        "kind": kind.name,
        "key": key.as_dict(),
        "source": f"{KERNEL_DIR}/{key.id}.py",
        "sha256": source_sha256(source),
        "functions": kind.functions(key),
        "admission": kind.admission(key),
        "weights": weights,
        "min_capability": MIN_CAPABILITY,
        "aot": kind.compile(key) if aot else None,
    }


def check_keys(keys: dict[Any, list[str]], m: Module) -> None:
    layouts: dict[str, str] = {}
    for key, names in keys.items():
        kind = kind_of(key)
        layouts |= dict.fromkeys(names, kind.layout)
        for dtype in kind.dtypes(key):
            if dtype not in TL_DTYPE:
                raise EmitError(f"{names[0]}: the triton kernels run f16/bf16/f32 values, not {dtype} ({key.id})")
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is None:
            continue
        want = layouts.get(weight_name(op), "triton-kn")
        if t.pack.family != want:
            raise EmitError(f"{op.attrs['codes']}: codes are in layout {t.pack.family}, its kernels read {want}")


def refs(binding: dict[str, AttrValue]) -> list[str]:
    """Every tensor a q.weight's binding names, nested qparams included."""
    out: list[str] = []
    for v in binding.values():
        if isinstance(v, SymbolRef):
            out.append(v.name)
        elif isinstance(v, dict):
            out += refs(v)  # pyright: ignore[reportUnknownArgumentType]
    return out


def ledger(m: Module) -> tuple[dict[str, int], int]:
    """Bytes each quantized weight's tensors take, and every parameter (a quantized weight counts N x K)."""
    stored: dict[str, int] = {}
    owned: set[str] = set()
    all_params = 0
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is None:
            continue
        names = refs(op.attrs)
        stored[weight_name(op)] = sum(m.tensors[r].blob.nbytes for r in names)
        owned.update(names)
        all_params += int(t.shape[0]) * int(t.shape[1])
    all_params += sum(math.prod(d.blob.shape) for n, d in m.tensors.items() if n not in owned)
    return stored, all_params


def emit(m: Module, req: ArtifactRequest) -> Path:
    from qcompiler.backends.triton.read import RECORD, evidence_digests, open_triton

    keys = module_kernels(m)
    check_keys(keys, m)
    aot = bool(req.options.get("aot", True))
    sources = {key: kind_of(key).generate(key) for key in keys}
    entries = [kernel_entry(key, sources[key], names, aot) for key, names in keys.items()]
    index = {
        "codegen_version": CODEGEN_VERSION,
        "triton": triton.__version__,
        "targets": [f"sm_{cc}" for cc in TARGETS] if aot else [],
        "kernels": entries,
    }
    tensors = [
        TensorBytes(name, ST_DTYPE[d.blob.dtype.name], d.blob.shape, read_blob(d, m.base_dir))
        for name, d in m.tensors.items()
    ]
    graph = relocated(m, {name: f"safetensors:{MODEL_FILE}#{name}" for name in m.tensors})
    stored, all_params = ledger(m)
    with ArtifactWriter(req.out, fail_at=req.fail_at, force=req.force) as w:
        w.write_file(MODEL_FILE, serialize(tensors, METADATA))
        for key, source in sources.items():
            w.write_file(f"{KERNEL_DIR}/{key.id}.py", source.encode())
        index_bytes = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        w.write_file(INDEX_FILE, index_bytes)
        record = {RECORD: evidence_digests(json.loads(index_bytes))}
        w.write_file("graph.qir", print_module(with_record(graph, record)).encode())
        finish(
            w,
            m,
            req,
            Finish(
                target="triton",
                reopen=lambda path: open_triton(path, None),
                container="safetensors/1+triton-kernels",
                versions={
                    "required_kernels": [e["id"] for e in entries],
                    "codegen": f"qcompiler-triton/v{CODEGEN_VERSION}",
                    "triton": triton.__version__,
                    "min_capability": MIN_CAPABILITY,
                },
                topology={"file_shards": 1},
                stored=stored,
                all_params=all_params,
            ),
        )
    return req.out
