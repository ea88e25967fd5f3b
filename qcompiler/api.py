"""The Python API: ``qcompiler.quantize``, ``qcompiler.capture`` and ``capture_source``.

import qcompiler
model = qcompiler.quantize(model, "w4-g32")                     # codes frozen from here on
module = qcompiler.capture(model, (input_ids,), dynamic={"input_ids": {1: "seq"}})
captured = qcompiler.capture_source("path/to/hf-dir", scheme="w8-channel")
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from qcompiler.artifact.request import SourceInfo, model_dtype
from qcompiler.errors import UsageError
from qcompiler.frontend.capture import capture, export_program
from qcompiler.frontend.forked import available, bind, forked_capture, placeholders
from qcompiler.frontend.hf import Capturable, Reading, load_source, prequantized
from qcompiler.frontend.hf_dir import read_config
from qcompiler.frontend.rebuilt import Work
from qcompiler.frontend.requantize import planned, quantized, stand_up
from qcompiler.frontend.skeleton import is_fake
from qcompiler.frontend.source_info import (
    checkpoint_state,
    hf_model,
    mark_roles,
    source_info,
    tied_aliases,
    used_modules,
)
from qcompiler.frontend.stream import (
    NotStreamable,
    Prepared,
    Streamed,
    WeightHook,
    prepare_hf_dir,
    stream_prepared,
    swap_in,
)
from qcompiler.ir.core import Module
from qcompiler.ir.parser import parse_module
from qcompiler.quant.conv1d import is_linear, linear_weight
from qcompiler.quant.modules import QuantEmbedding, QuantLinear, quantize
from qcompiler.quant.registry import whole_model
from qcompiler.quant.torchao_adopt import adopt_torchao, is_torchao

AheadFactory = Callable[[Mapping[str, str]], WeightHook]
"""The compile's per-weight hook, made from the module's provenance (``passes/ahead.py``)."""


@dataclass
class Captured:
    """A captured module plus what the parity rungs compare it with."""

    module: Module
    effective: Mapping[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])
    """Weight name -> the weight the model used before export (its dequantized form; a
    pre-quantized source's is computed when read)."""
    float_weights: Mapping[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])
    """Weight name -> the float weight before quantization, when qcompiler quantized it."""
    source: SourceInfo | None = None
    """config.json, tokenizer files and hashes of the source (what a checkpoint artifact carries)."""
    model: nn.Module | None = None
    """The (quantized) PyTorch module that was exported."""


def effective_weights(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for fqn, mod in model.named_modules():
            weight_of: Callable[[], torch.Tensor] | None = getattr(mod, "dequantized_weight", None)
            if any(is_fake(b) for b in mod.buffers(recurse=False)):
                continue  # a streamed source's: freeze-semantics evaluates its decode, weight by weight
            if weight_of is not None:  # a frozen module, of any scheme
                out[f"{fqn.removeprefix(prefix)}.weight"] = weight_of().detach().clone()
    return out


def capture_source(
    source: str,
    *,
    scheme: str | None = None,
    embeddings: bool = False,
    jobs: int = 1,
    progress: Callable[[int], Callable[[int], None]] | None = None,
    scales: str = "f32",
    ahead: AheadFactory | None = None,
) -> Captured:
    """Load a SOURCE (HF directory or ``pkg.module:factory``), quantize it when ``scheme`` is given
    (torchao weights are adopted as they are), and capture it. An HF directory is streamed
    (``frontend/stream.py``: the model is never held, ``jobs`` workers quantize tensor by tensor;
    ``scales`` ``source`` keeps a bf16/fp16 source's dtype for its scales, as the target allows;
    ``ahead(provenance)``: the hook each worker calls on the weight it quantized, ``passes/ahead.py``)."""
    reason = "not an HF directory"
    method = prequantized(Path(source))
    if method is not None:
        if scheme:
            raise UsageError(
                f"{source} is already quantized ({method}): its codes are compiled as they are, and --scheme "
                f"{scheme} would requantize them; drop --scheme, or compile the float model with it"
            )
        reason = f"a pre-quantized {method} checkpoint, read as stored"
    elif Path(source).is_dir() and (Path(source) / "config.json").is_file():
        try:
            return capture_streamed(source, scheme, embeddings, jobs, progress, scales, ahead)
        except NotStreamable as e:
            reason = str(e)
    captured = capture_loaded(source, scheme, embeddings, scales, jobs, progress, ahead)
    held = captured.model is None or holds_weights(captured.model)
    captured.module.attrs["provenance"]["frontend"] = f"{'in memory' if held else 'streamed'} ({reason})"  # type: ignore[index]
    return captured


def holds_weights(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` holds data (a streamed source's are all fake)."""
    return any(not is_fake(t) for t in [*model.parameters(), *model.buffers()])


def capture_streamed(
    source: str,
    scheme: str | None,
    embeddings: bool,
    jobs: int,
    progress: Callable[[int], Callable[[int], None]] | None,
    scales: str = "f32",
    ahead: AheadFactory | None = None,
) -> Captured:
    path = Path(source)
    p = prepare_hf_dir(path, scheme, embeddings=embeddings, scales=scales, stand_ins=True, early=True)
    c = p.cap
    hf = hf_model(c)
    assert hf is not None
    prov = {"source": source, **{k: str(v) for k, v in c.provenance.items()}, "frontend": "streamed"}
    prov.update(model_dtype(SourceInfo(source, read_config(path))))
    if scheme:
        prov["scheme"] = scheme
    args: dict[str, Any] = {"dynamic": c.dynamic, "name": c.name, "provenance": prov, "buffers": p.buffers}
    s, m = stream_and_capture(p, jobs, progress, args, None if ahead is None else ahead(prov))
    info = source_info(source, c, {}, s.file_sha256)
    mark_roles(m, dict.fromkeys(s.state_names), tied_aliases(hf), lazy=s.refs)
    m.base_dir = str(path.resolve())  # dense tensors are read from the source's shards
    return Captured(m, {}, s.floats, info, None)


def stream_and_capture(
    p: Prepared,
    jobs: int,
    progress: Callable[[int], Callable[[int], None]] | None,
    args: dict[str, Any],
    ahead: WeightHook | None = None,
) -> tuple[Streamed, Module]:
    """Read and quantize the weights (``stream_prepared``) while the model, its quantized modules
    replaced by stand-ins (``frontend/stand_ins.py``), is exported and lowered in a forked child
    (``frontend/forked.py``); the child's module is used only if every real module traces as its
    stand-in did. Without a child (or when it failed) the export runs in this process beside the
    reading, and an export error or an interrupt stops the reading at its next tensor before it is
    raised; a reading error is raised once the export is done."""
    c = p.cap
    if not p.stand_ins:
        s = stream_prepared(p, jobs, progress, ahead=ahead)
        return s, capture(c.module, c.inputs, **args, lazy=s.refs)
    holes = placeholders(p.shards, p.stand_ins)
    stop = threading.Event()
    ep: ExportedProgram | None = None
    text: str | None = None
    with (
        forked_capture(c.module, c.inputs, {**args, "lazy": holes}) as child,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="qc-stream") as pool,
    ):
        reading = pool.submit(stream_prepared, p, jobs, progress, stop, False, ahead)
        try:
            text = child.text() if child is not None else None
            if text is None:  # no child, or it failed: export here (an error is raised here, named)
                ep = export_program(c.module, c.inputs, c.dynamic)
            s = reading.result()
        except BaseException:
            stop.set()
            wait([reading])
            raise
    swap_in(p, s)  # the model's fake mode is the export's: only now, the export done
    if s.stand_ins_held and text is not None:
        bound = bind(parse_module(text, "<export>"), holes, s.refs)
        if bound is not None:
            return s, bound
    return s, capture(c.module, c.inputs, **args, lazy=s.refs, exported=ep if s.stand_ins_held else None)


def capture_loaded(
    source: str,
    scheme: str | None,
    embeddings: bool,
    scales: str = "f32",
    jobs: int = 1,
    progress: Callable[[int], Callable[[int], None]] | None = None,
    ahead: AheadFactory | None = None,
) -> Captured:
    c = load_source(source, streamed=not whole_model(scheme), work=source_work(source, jobs, ahead, scheme))
    floats: Mapping[str, torch.Tensor] = {}
    if scheme and c.lazy is not None and not holds_weights(c.module):
        try:
            floats = requantize_streamed(c, source, scheme, embeddings, jobs, progress, scales, ahead)
        except NotStreamable:  # a tie only the in-memory quantizer answers: read the source again, whole
            c = load_source(source, streamed=False)
    hf = hf_model(c)
    state = c.state if c.state is not None else checkpoint_state(hf) if hf is not None else {}
    # what the artifact carries: a factory's own frozen modules' buffers are covered by their q.weight
    frozen = (QuantLinear, QuantEmbedding)
    carried = checkpoint_state(hf, frozen) if c.state is None and hf is not None else state
    info = c.source if isinstance(c.source, SourceInfo) else source_info(source, c, state)
    torchao_effective: dict[str, torch.Tensor] = {}
    if any(is_torchao(p) for p in c.module.parameters()):
        torchao_effective = {k.removeprefix("hf."): v for k, v in adopt_torchao(c.module).items()}
    if scheme and holds_weights(c.module):
        floats = {
            f"{fqn.removeprefix('hf.')}.weight": linear_weight(mod).clone()
            for fqn, mod in c.module.named_modules()
            if is_linear(mod) or isinstance(mod, nn.Embedding)
        }
        quantize(c.module, scheme, embeddings=embeddings, only=used_modules(c.module, c.inputs), scales=scales)
    override: Mapping[str, torch.Tensor] = torchao_effective
    if c.effective is not None:  # a pre-quantized format's own decode, computed weight by weight when read
        effective = override = c.effective
    else:
        effective = {**effective_weights(c.module, "hf."), **torchao_effective}
    prov = {"source": source, **{k: str(v) for k, v in c.provenance.items()}, **model_dtype(info)}
    if scheme:
        prov["scheme"] = scheme
    args: dict[str, Any] = {
        "dynamic": c.dynamic,
        "name": c.name,
        "provenance": prov,
        "effective": override,
        "buffers": c.buffers,
    }
    m = capture_beside(c, args) if c.reading is not None else capture(c.module, c.inputs, **args, lazy=c.lazy)
    if hf is not None:
        mark_roles(m, carried, tied_aliases(hf), lazy=c.lazy)
    if c.base_dir is not None:
        m.base_dir = c.base_dir  # dense tensors are read from the source's shards
    if not holds_weights(c.module):  # streamed: rung 2 is held to the emitted module, rung 3 reads the source
        return Captured(m, effective, floats, info, c.module)
    return Captured(m, effective, {k: v for k, v in floats.items() if k in effective}, info, c.module)


def source_work(source: str, jobs: int, ahead: AheadFactory | None, scheme: str | None = None) -> Work:
    """How ``load_source`` fills the model: ``jobs`` threads, and for a pre-quantized directory or a
    single file compiled as it is (a ``.gguf`` without ``--scheme``), the compile's per-weight hook
    (``passes/ahead.py``: each layer frozen and packed as it is read), the layers read beside the
    export where a child can export."""
    if prequantized(Path(source)) is None:
        if scheme or not Path(source).is_file():
            return Work(jobs)
        return Work(jobs, beside=available(), ahead=ahead)
    if ahead is None:
        return Work(jobs, beside=available())
    config = {k: v for k, v in read_config(Path(source), quantized=True).items() if k != "quantization_config"}
    hook = ahead(model_dtype(SourceInfo(source, config)))
    return Work(jobs, getattr(hook, "prequantized", None), beside=available())


def capture_beside(c: Capturable, args: dict[str, Any]) -> Module:
    """Capture ``c`` while its source reads its quantized layers (``Capturable.reading``): the model,
    its quantized modules' stand-ins swapped in, is exported and lowered in a forked child with a
    placeholder for every tensor the reading stores (``frontend/forked.py``), the reading runs here.
    The child's module is used, its placeholders bound to the reading's references, when every real
    module is the one its stand-in showed; else (or without a child) the export runs here, after."""
    reading = c.reading
    assert reading is not None
    assert c.lazy is not None
    text: str | None = None
    with forked_capture(c.module, c.inputs, {**args, "lazy": {**c.lazy, **reading.holes}}) as child:
        if child is None:
            held = reading.read()
        else:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="qc-read") as pool:
                job = pool.submit(reading.read)
                try:
                    text = child.text()
                except BaseException:
                    wait([job])  # an interrupt stops the reading at its next layer
                    raise
                held = job.result()
    if held and text is not None:
        bound = bind(parse_module(text, "<export>"), reading.holes, c.lazy)
        if bound is not None:
            return bound
    return capture(c.module, c.inputs, **args, lazy=c.lazy)


def requantize_streamed(
    c: Capturable,
    source: str,
    scheme: str,
    embeddings: bool,
    jobs: int,
    progress: Callable[[int], Callable[[int], None]] | None,
    scales: str,
    ahead: AheadFactory | None,
) -> Mapping[str, torch.Tensor]:
    """``frontend/requantize.py`` on a streamed source, the per-weight hook made for its provenance:
    where a child can export (``forked.available``) and every stand-in can be told, the model stands
    ready on them and the quantization is left to ``c.reading`` (``capture_beside`` runs it)."""
    info = c.source if isinstance(c.source, SourceInfo) else None
    prov = {"source": source, **{k: str(v) for k, v in c.provenance.items()}}
    if info is not None:
        prov.update(model_dtype(info))
    hook = None if ahead is None else ahead(prov)
    r = planned(c, scheme, embeddings, scales)  # NotStreamable before anything is read or changed
    holes = stand_up(r) if available() else None
    if holes is None:
        quantized(r, jobs, progress, hook)
    else:  # the model stands ready on stand-ins: exported in a child while the weights are quantized
        c.reading = Reading(holes, lambda: quantized(r, jobs, progress, hook))
    return r.floats


__all__ = ["Captured", "capture", "capture_source", "quantize"]
