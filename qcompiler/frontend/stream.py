"""An HF-style directory compiled without ever holding the model: the streaming frontend.

``stream_hf_dir(path, scheme)``:

1. runs the directory's gates (``hf_dir.check_source``: config, shard headers, the no-random-weights
   inventory check) before anything heavy;
2. builds the model under a ``FakeTensorMode`` (shapes only) and plans which modules ``--scheme``
   quantizes (``quantize_plan``: the same choice ``qcompiler.quantize`` makes);
3. reads every shard once, front to back (``reading.py``; the files' sha256 computed early, beside
   steps 1-2, or as they are read). Each tensor is a job for a pool of ``jobs`` workers with at most
   ``2 * jobs`` tensors resident: a planned weight is quantized (``quantize_module``; for a target
   that holds them, a bf16 weight gets bf16 scales), the compile's ``WeightHook`` freezes and packs it
   while it is held (``passes/ahead.py``), and its codes and qparams go to the blob store (spilled to
   disk during a compile); any other tensor is hashed and referenced where it lies
   (``safetensors:SHARD#TENSOR``: never copied, read when written);
4. swaps each quantized module, its buffers made fake, into the skeleton, so ``torch.export`` traces
   exactly the graph ``qcompiler.quantize`` + ``capture`` would, and the lowering binds every
   tensor-table entry to the reference made here (``Streamed.refs``).

``prepare_hf_dir`` (steps 1-2) and ``stream_prepared`` (3-4) are apart so that a compile exports the
model while it is read (``api.stream_and_capture``, in a forked child: ``forked.py``): the export
traces stand-ins of the quantized modules (``stand_ins.py``) and is kept only if every real module
traces alike.

The output bytes are the same for any ``jobs``: each tensor's result depends on that tensor alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from qcompiler.frontend.context import to_numpy
from qcompiler.frontend.hf import PREFIX, Capturable, wrap_hf
from qcompiler.frontend.reading import (
    ST_IR,
    ST_TORCH,
    Buffer,
    EarlyDigests,
    SourceTensor,
    as_tensor,
    read_tensor,
    source_tensors,
    stream_tensors,
)
from qcompiler.frontend.skeleton import fake_copy, fake_model, real_buffers
from qcompiler.frontend.stand_ins import same_module, stand_in, with_weight
from qcompiler.ir.blobs import derived, hashed, keep_bytes, vouch
from qcompiler.ir.core import BlobRef
from qcompiler.ir.dtypes import DTYPES
from qcompiler.quant.conv1d import is_conv1d


class NotStreamable(Exception):
    """This source needs the in-memory frontend (the reason is recorded in the provenance)."""


@dataclass
class Streamed:
    """What the streaming frontend hands to ``capture``."""

    capturable: Capturable
    refs: dict[str, BlobRef]
    """Tensor-table name -> where its bytes are (source shard, or the blob store for codes)."""
    buffers: dict[str, torch.Tensor]
    """Non-persistent buffers by name, computed for real."""
    file_sha256: dict[str, str]
    floats: FloatWeights
    plan: dict[str, str]
    state_names: list[str] = field(default_factory=list[str])
    stand_ins_held: bool = False
    """Whether ``capture`` may use the program exported from the stand-ins (``Prepared.stand_ins``)."""
    modules: dict[str, nn.Module] = field(default_factory=dict[str, nn.Module])
    """fqn -> each quantized module (buffers on meta: the codes are in the blob store)."""
    """The model's checkpoint tensors (parameters, tied ones once, persistent buffers) before quantization."""


class FloatWeights(Mapping[str, torch.Tensor]):
    """Quantized weight name -> its source float weight in the source's dtype (rung 3 widens it to
    float64 exactly), read from the shard on demand; a ``Conv1D``'s (``transposed``) as the ``[N, K]``
    Linear weight it computes."""

    def __init__(self, root: Path, tensors: dict[str, SourceTensor], transposed: frozenset[str] = frozenset()) -> None:
        self.root, self.tensors, self.transposed = root, tensors, transposed

    def __getitem__(self, name: str) -> torch.Tensor:
        t = read_tensor(self.root, self.tensors[name])
        return t.t() if name in self.transposed else t

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of a weight, reading only their bytes (``parity_rows.RowSource``)."""
        if name in self.transposed:  # rows of W.T are columns of the source: the whole weight is read
            return self[name][r0:r1]
        t = self.tensors[name]
        row = t.nbytes // t.shape[0] if t.shape and t.shape[0] else 0
        piece = dataclasses.replace(
            t, shape=(r1 - r0, *t.shape[1:]), offset=t.offset + r0 * row, nbytes=(r1 - r0) * row
        )
        return read_tensor(self.root, piece)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


Recipes = Mapping[str, Callable[[], np.ndarray]]
WeightHook = Callable[
    [str, nn.Module, Mapping[str, BlobRef], Mapping[str, np.ndarray], torch.Tensor | None], Recipes | None
]
"""Called by the worker that quantized a weight, while it holds it: ``(name, quantized module, its
buffers' references by buffer name, the buffers' arrays, the float weight or ``None`` when the
source holds none: a quantized ``.gguf``)``; the compile freezes and packs it there
(``passes/ahead.py``). It may return, by buffer name, how to make a buffer again from what it stored
(``blobs.derived``): that buffer's bytes are then not stored."""


def quantize_job(
    t: SourceTensor,
    data: Buffer,
    scheme: str,
    template: nn.Module,
    scales: str,
    ahead: WeightHook | None = None,
) -> dict[str, Any]:
    """Quantize one source weight; returns its buffers' blob refs and the quantized module."""
    return quantize_weight(t.name, as_tensor(data, t), scheme, template, scales, ahead)


def quantize_weight(
    name: str,
    weight: torch.Tensor,
    scheme: str,
    template: nn.Module,
    scales: str,
    ahead: WeightHook | None = None,
) -> dict[str, Any]:
    """``quantize_job`` of weight ``name`` (as stored: a ``Conv1D``'s ``[K, N]``) held in memory: its
    buffers hashed into the blob store under ``<name>.<buffer>`` (or made again by the recipes the
    ``ahead`` hook returns), the quantized module's buffers left on meta."""
    from qcompiler.quant.modules import quantize_module

    new = quantize_module(with_weight(template, weight), scheme, torch.float32, scales)
    weight = weight.t() if is_conv1d(template) else weight  # the [N, K] weight the codes quantize
    refs: dict[str, BlobRef] = {}
    own: dict[str, BlobRef] = {}
    arrays: dict[str, np.ndarray] = {}
    unstored: dict[str, memoryview | None] = {}
    for sub in new.modules():
        for bname, b in list(sub._buffers.items()):
            if b is not None:
                arr, dtype = to_numpy(b)
                ref, unstored[bname] = hashed(arr, DTYPES[dtype])
                refs[f"{name}.{bname}"] = own[bname] = ref
                arrays[bname] = arr
                sub._buffers[bname] = b.to("meta")  # the codes live in the blob store from here on
    recipes = ahead(name, new, own, arrays, weight) if ahead is not None else None
    for bname, pending in unstored.items():
        make = (recipes or {}).get(bname)
        if make is not None:
            derived(own[bname], make)  # e.g. logical codes, made again from the packed ones if read
        elif pending is not None:
            keep_bytes(own[bname].sha256, pending)
    return {"refs": refs, "module": new}


def dense_job(t: SourceTensor, data: Buffer) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    ref = BlobRef(DTYPES[ST_IR[t.dtype]], t.shape, digest, f"safetensors:{t.file}#{t.name}")
    return {"refs": {t.name: ref}, "file": t.file}


Advance = Callable[[int], None]


def stream_hf_dir(
    path: Path,
    scheme: str | None,
    *,
    embeddings: bool = False,
    jobs: int = 1,
    progress: Callable[[int], Advance] | None = None,
    scales: str = "f32",
) -> Streamed:
    """The directory as a ``Streamed`` source (see the module docstring). ``progress(total_bytes)``
    returns the callback advanced by each tensor's bytes; ``scales``: ``source`` stores a bf16/fp16
    weight's scales in its dtype (``quantize_module``). Raises ``NotStreamable`` for what only the
    in-memory frontend handles (a quantized weight tied to another)."""
    return stream_prepared(prepare_hf_dir(path, scheme, embeddings=embeddings, scales=scales), jobs, progress)


@dataclass
class Prepared:
    """A directory past its gates, its model built on fake tensors, before any weight is read."""

    path: Path
    cap: Capturable
    mode: FakeTensorMode
    plan: dict[str, str]
    templates: dict[str, nn.Module]
    """Quantized weight name -> the float module it replaces."""
    shards: dict[str, list[SourceTensor]]
    buffers: dict[str, torch.Tensor]
    state_names: list[str]
    scales: str
    stand_ins: dict[str, nn.Module] = field(default_factory=dict[str, nn.Module])
    """fqn -> the stand-in swapped into ``cap.module`` (``stand_ins.py``): all of them, or none."""
    early: EarlyDigests | None = None
    """The shards' sha256, computed while the directory was prepared."""


def prepare_hf_dir(
    path: Path,
    scheme: str | None,
    *,
    embeddings: bool = False,
    scales: str = "f32",
    stand_ins: bool = False,
    early: bool = False,
) -> Prepared:
    """Steps 1-2 of the module docstring; with ``stand_ins``, each planned module is replaced by its
    stand-in, so the model can be exported while ``stream_prepared`` reads the weights; with
    ``early``, the shards are hashed in a thread meanwhile (``reading.EarlyDigests``)."""
    digests = EarlyDigests(path) if early else None
    try:
        p = prepared(path, scheme, embeddings, scales, stand_ins)
    except BaseException:
        if digests is not None:
            digests.stop()
        raise
    p.early = digests
    return p


def prepared(path: Path, scheme: str | None, embeddings: bool, scales: str, stand_ins: bool) -> Prepared:
    from qcompiler.frontend.hf_dir import check_source, guarded
    from qcompiler.frontend.source_info import checkpoint_state, tied_aliases, used_modules
    from qcompiler.frontend.stamp import used_by_layers
    from qcompiler.quant.experts import unfuse_experts
    from qcompiler.quant.modules import quantize_plan, swap_module
    from qcompiler.quant.registry import whole_model

    auto, cfg, _ = check_source(path)
    if whole_model(scheme):
        raise NotStreamable(f"scheme {scheme} quantizes the whole model at once")

    def build() -> Any:
        return unfuse_experts(auto.from_config(cfg, dtype=torch.float32))

    model, mode = guarded(path, "build this model from config.json", lambda: fake_model(build))
    buffers = guarded(path, "build this model's buffers", lambda: real_buffers(build))
    state_names = list(checkpoint_state(model))
    cap = wrap_hf(model.eval(), path.name)
    cap.provenance["source_dir"] = path.name
    plan: dict[str, str] = {}
    if scheme:
        with mode:
            used = used_by_layers(cap.module, cfg, lambda: used_modules(cap.module, cap.inputs))
        plan = quantize_plan(cap.module, scheme, embeddings=embeddings, only=used)
    aliases = tied_aliases(model)
    tied = {PREFIX + a.removesuffix(".weight") for pair in aliases.items() for a in pair}
    if set(plan) & tied:
        raise NotStreamable(f"quantized weight {sorted(set(plan) & tied)[0]} is tied to another")
    templates = {fqn.removeprefix(PREFIX) + ".weight": cap.module.get_submodule(fqn) for fqn in plan}
    shards = source_tensors(path)
    p = Prepared(path, cap, mode, plan, templates, shards, buffers, state_names, scales)
    if stand_ins:
        dtypes = {t.name: ST_TORCH[t.dtype] for ts in shards.values() for t in ts}
        kinds: dict[tuple[Any, ...], nn.Module | None] = {}
        made = {
            fqn: stand_in(templates[w], plan[fqn], dtypes[w], scales, mode, kinds) if w in dtypes else None
            for w, fqn in ((fqn.removeprefix(PREFIX) + ".weight", fqn) for fqn in plan)
        }
        if all(v is not None for v in made.values()):
            p.stand_ins = {k: v for k, v in made.items() if v is not None}
            for fqn, mod in p.stand_ins.items():
                swap_module(cap.module, fqn, mod)
    return p


def stream_prepared(
    p: Prepared,
    jobs: int,
    progress: Callable[[int], Advance] | None = None,
    stop: threading.Event | None = None,
    swap: bool = True,
    ahead: WeightHook | None = None,
) -> Streamed:
    """Step 3-4 of the module docstring (``swap``: step 4 now, else by ``swap_in`` later);
    ``Streamed.stand_ins_held`` says whether every real module traces as its stand-in did
    (``stand_ins.same_module``). ``ahead`` is called in the worker after each weight is quantized."""

    def job(t: SourceTensor, data: Buffer) -> dict[str, Any]:
        template = p.templates.get(t.name)
        if template is None:
            return dense_job(t, data)
        fqn = PREFIX + t.name.removesuffix(".weight")
        return {"fqn": fqn, **quantize_job(t, data, p.plan[fqn], template, p.scales, ahead)}

    total = sum(t.nbytes for ts in p.shards.values() for t in ts)
    advance: Advance = progress(total) if progress is not None else (lambda n: None)  # pyright: ignore[reportUnknownLambdaType]
    unchanged: dict[str, os.stat_result] = {}
    try:
        results, digests = stream_tensors(p.path, p.shards, job, jobs, advance, stop, p.early, unchanged)
    finally:
        if p.early is not None:
            p.early.stop()
    refs: dict[str, BlobRef] = {}
    held = bool(p.stand_ins)
    base = str(p.path.resolve())  # the captured module's ``base_dir``
    for r in results:
        refs.update(r["refs"])
        if r.get("file") in unchanged:  # hashed as read: the writer and the graph probe need not hash it again
            for ref in r["refs"].values():
                vouch(ref.location, base, r["file"], ref.sha256, unchanged[r["file"]])
        if "module" in r:
            stand = p.stand_ins.get(r["fqn"])
            held = held and stand is not None and same_module(stand, r["module"])
    transposed = frozenset(w for w, mod in p.templates.items() if is_conv1d(mod))
    floats = FloatWeights(
        p.path, {t.name: t for ts in p.shards.values() for t in ts if t.name in p.templates}, transposed
    )
    modules = {r["fqn"]: r["module"] for r in results if "module" in r}
    s = Streamed(p.cap, refs, p.buffers, digests, floats, p.plan, p.state_names, held, modules)
    if swap:
        swap_in(p, s)
    return s


def swap_in(p: Prepared, s: Streamed) -> None:
    """Swap each quantized module, its buffers made fake, into the model. Under the model's fake mode,
    which ``torch.export`` uses too: never while an export runs in another thread."""
    from qcompiler.quant.modules import swap_module

    for fqn, mod in s.modules.items():
        swap_module(p.cap.module, fqn, fake_copy(mod, p.mode))
