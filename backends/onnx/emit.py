"""Write an ONNX artifact: ``model.onnx`` (the graph; initializers of 1 KiB or more in ``model.onnx.data``
at page-aligned offsets), the runtime files (tokenizer, config.json, generation and genai configs:
``package.py``), ``graph.qir`` (its tensors point into the ONNX initializers; its ``bound`` record
holds the runtime files' sha256) and ``manifest.json`` last. The QIR graph is lowered op by op
(``lower.py``), quantized weights by the form's ``WeightForm`` (``weights.py``). A causal LM's
``model.onnx`` is its KV-cache decoder graph (``kv_cache.py``; its attention decomposed into plain ops,
or with the ``attention`` option ``gqa`` (``--onnx-attention gqa``) onnxruntime's ``GroupQueryAttention``:
``gqa.py``); with the ``no_cache_graph`` option
(``--onnx-no-cache-graph``) the graph as captured, ``input_ids`` in and ``logits`` out, is written
beside it as ``model_no_cache.onnx``, sharing ``model.onnx.data``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from qcompiler.artifact.manifest import TOKENIZER_FILES
from qcompiler.artifact.publish import EmitError, Finish, finish, relocated
from qcompiler.artifact.request import ArtifactRequest
from qcompiler.artifact.writer import ArtifactWriter
from qcompiler.backends.onnx import gqa, package
from qcompiler.backends.onnx.builder import OnnxBuilder
from qcompiler.backends.onnx.external import StreamedInitializers, tensor_nbytes
from qcompiler.backends.onnx.genai import DECODER_FILE
from qcompiler.backends.onnx.genai import TESTED as TESTED_GENAI
from qcompiler.backends.onnx.kv_cache import ATTENTIONS, DECOMPOSED, kv_cache_for
from qcompiler.backends.onnx.lower import lower_graph
from qcompiler.backends.onnx.weights import MODEL_FILE, NO_CACHE_FILE, WeightForm
from qcompiler.ir.core import Module
from qcompiler.ir.facts import with_record
from qcompiler.ir.parser import parse_module
from qcompiler.ir.printer import print_module

OPSET = 21
IR_VERSION = 10
"""Opset 21 (int4 and blocked ``DequantizeLinear``) needs IR version 10."""
DATA_FILE = "model.onnx.data"
TESTED_RUNTIMES = {"onnxruntime": "1.32.0", "onnx": "1.23.2", "onnxruntime-genai": TESTED_GENAI}
DEFAULT_ACCURACY = 1
"""``accuracy_level`` when not given: 1 computes in fp32 (exact up to float rounding); 4 quantizes
activations to int8 per block (faster, error about 5e-3 relative)."""
REGISTERED = (gqa,)
"""The modules whose ``attention_form`` entries fill ``kv_cache.ATTENTIONS`` (imported for that)."""


def build_model(
    m: Module,
    form: str,
    accuracy_level: int,
    kv: bool = True,
    initializers: list[onnx.TensorProto] | None = None,
    attention: str = DECOMPOSED,
) -> tuple[onnx.ModelProto, WeightForm]:
    """The ONNX model of ``m``'s graph: with ``kv``, a causal LM's is its KV-cache decoder graph, its
    attention in the form ``attention`` (``kv_cache.ATTENTIONS``); without, the graph as captured.
    ``initializers``: the list the builder appends to (``StreamedInitializers`` writes the large ones
    to the external data file as they are made)."""
    weights = WeightForm(form, accuracy_level)
    b = OnnxBuilder(m, m.graphs[0], weights=weights, kv=kv_cache_for(m.graphs[0], attention) if kv else None)
    if initializers is not None:
        b.initializers = initializers
    inputs, outputs = lower_graph(b)
    graph = helper.make_graph(b.nodes, m.name, inputs, outputs, b.initializers)
    opsets = [helper.make_opsetid("", OPSET)]
    if any(n.domain == "com.microsoft" for n in b.nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="qcompiler", ir_version=IR_VERSION)
    return model, weights


def no_cache_of(m: Module, form: str, accuracy_level: int, main: StreamedInitializers) -> onnx.ModelProto:
    """A causal LM's graph as captured (no cache), its large initializers pointing at the bytes
    ``model.onnx`` stored (the same names and sha256, checked one at a time)."""
    shared = StreamedInitializers(DATA_FILE, shared=main)
    try:
        no_cache, _ = build_model(m, form, accuracy_level, kv=False, initializers=shared)
    except ValueError as e:
        raise EmitError(str(e)) from None
    return no_cache


def is_causal_lm(m: Module) -> bool:
    """Whether ``model.onnx`` is the KV-cache decoder graph (else the only graph)."""
    return kv_cache_for(m.graphs[0]) is not None


def canonical(m: Module) -> Module:
    """``m`` as its ``graph.qir`` reads back (value names made unique the way the printer does), so the
    ONNX node and initializer names emit derives from value names are the ones the binding gate derives
    from the artifact's ``graph.qir``; tensors keep their locations."""
    out = parse_module(print_module(m), f"<{m.name}>")
    out.base_dir = m.base_dir
    return out


def ledger(model: onnx.ModelProto, weights: WeightForm) -> tuple[dict[str, int], int]:
    """Bytes each quantized weight's initializers take (``W.B``, ``W.scales`` ...), and every parameter
    the model holds (a quantized weight counts its logical ``N x K``)."""
    owners = {w.name: w for w in weights.weights.values()}
    stored: dict[str, int] = dict.fromkeys(owners, 0)
    params = sum(int(w.t.shape[0]) * int(w.t.shape[1]) for w in owners.values())
    for t in model.graph.initializer:
        owner = next((n for n in owners if t.name.startswith(f"{n}.")), None)
        if owner is not None:
            stored[owner] += tensor_nbytes(t)
        else:
            params += math.prod(int(d) for d in t.dims)
    return stored, params


def source_config(req: ArtifactRequest) -> dict[str, Any] | None:
    return req.source.config if req.source is not None else None


def with_runtime_files(req: ArtifactRequest, runtime: package.Package) -> ArtifactRequest:
    """``req`` whose source files are the tokenizer files the artifact holds (a derived
    generation_config.json too), so the manifest's ``tokenizer_sha256`` is over what the reader finds."""
    src = req.source
    if src is None:
        return req
    files = {n: d for n, d in runtime.files().items() if n in TOKENIZER_FILES}
    return dataclasses.replace(req, source=dataclasses.replace(src, files=files))


def emit(m: Module, req: ArtifactRequest, form: str) -> Path:
    """Write the artifact (see the module docstring); the ONNX models are lowered from ``canonical(m)``,
    exactly as the reader's binding gate lowers them again from ``graph.qir``."""
    from qcompiler.backends.onnx.read import open_onnx_dir

    accuracy = int(req.options.get("accuracy_level", DEFAULT_ACCURACY))
    no_cache = req.options.get("no_cache_graph", "False") == "True"
    attention = req.options.get("attention", DECOMPOSED)
    if no_cache and not is_causal_lm(m):
        raise EmitError(
            f"--onnx-no-cache-graph: {m.name} is not a causal LM graph (no causal attention over input_ids), "
            f"so {MODEL_FILE} has no cache and is its only graph"
        )
    if attention not in ATTENTIONS:
        raise EmitError(f"--onnx-attention: expected one of {', '.join(sorted(ATTENTIONS))}, found {attention!r}")
    if attention != DECOMPOSED and not is_causal_lm(m):
        raise EmitError(
            f"--onnx-attention {attention}: {m.name} is not a causal LM graph (no causal attention over "
            "input_ids), so it has no decoder graph whose attention could take that form"
        )
    m = canonical(m)
    with ArtifactWriter(req.out, fail_at=req.fail_at, force=req.force) as w:
        with w.stream(DATA_FILE) as data:  # initializers of 1 KiB or more go here as they are made

            def place(t: onnx.TensorProto, end: int, offset: int, raw: bytes) -> None:
                data.write(bytes(offset - end))
                data.write(raw)

            streamed = StreamedInitializers(DATA_FILE, place)
            model, weights = build_model(m, form, accuracy, initializers=streamed, attention=attention)
            extra = no_cache_of(m, form, accuracy, streamed) if no_cache else None
        stored, all_params = ledger(model, weights)
        graph = relocated(m, weights.locations, placed_only=True)
        models = {MODEL_FILE: model, **({NO_CACHE_FILE: extra} if extra is not None else {})}
        for name, written in models.items():
            w.write_file(name, written.SerializeToString())
        runtime = package.build(req.source, m, models.get(DECODER_FILE), accuracy)
        for name, blob in runtime.files().items():
            w.write_file(name, blob)
        graph = with_record(graph, runtime.record())
        w.write_file("graph.qir", print_module(graph).encode())
        finish(
            w,
            m,
            with_runtime_files(req, runtime),
            Finish(
                target=f"onnx-{form}",
                reopen=lambda path: open_onnx_dir(path, None, accuracy=accuracy),
                container=f"onnx/ir{IR_VERSION}-opset{OPSET}",
                versions={"tested_runtime": TESTED_RUNTIMES, "onnx_opset": OPSET, "onnx_form": form},
                provenance={
                    "accuracy_level": accuracy,
                    "no_cache_graph": no_cache,
                    "onnx_attention": attention,
                    "package": package.provenance(graph, source_config(req)),
                },
                topology={"file_shards": 1},
                stored=stored,
                all_params=all_params,
            ),
        )
    return req.out
