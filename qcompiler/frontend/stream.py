"""An HF-style directory compiled without ever holding the model: the streaming frontend.

``stream_hf_dir(path, scheme)``:

1. runs the directory's gates (``hf_dir.check_source``: config, shard headers, the no-random-weights
   inventory check) before anything heavy;
2. builds the model under a ``FakeTensorMode`` (shapes only) and plans which modules ``--scheme``
   quantizes (``quantize_plan``: the same choice ``qcompiler.quantize`` makes);
3. reads every shard once, front to back, hashing the file as it goes. Each tensor is a job for a
   pool of ``jobs`` workers with at most ``2 * jobs`` tensors resident: a planned weight is
   quantized (``quantize_module``; for a target that holds them, a bf16 weight gets bf16 scales) and its
   codes and qparams go to the blob store (spilled to disk during a compile); any other tensor is
   hashed and referenced where it lies (``safetensors:SHARD#TENSOR``: never copied, read when
   written);
4. swaps each quantized module, its buffers made fake, into the skeleton, so ``torch.export`` traces
   exactly the graph ``qcompiler.quantize`` + ``capture`` would, and the lowering binds every
   tensor-table entry to the reference made here (``Streamed.refs``).

``prepare_hf_dir`` (steps 1-2) and ``stream_prepared`` (3-4) are apart so that a compile exports the
model in one thread while another reads it (``api.stream_and_export``): the export traces stand-ins
of the quantized modules (``stand_ins.py``) and is kept only if every real module traces alike.

The output bytes are the same for any ``jobs``: each tensor's result depends on that tensor alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from qcompiler.frontend.context import TORCH_DTYPES, to_numpy
from qcompiler.frontend.hf import PREFIX, Capturable, wrap_hf
from qcompiler.frontend.skeleton import fake_copy, fake_model, real_buffers
from qcompiler.frontend.stand_ins import same_module, stand_in, with_weight
from qcompiler.heap import release_free_pages
from qcompiler.interrupt import check
from qcompiler.ir.blobs import put_array
from qcompiler.ir.core import BlobRef
from qcompiler.ir.dtypes import DTYPES
from qcompiler.parallel import ByteWindow

ST_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_IR = {name: TORCH_DTYPES[t] for name, t in ST_TORCH.items()}
"""safetensors dtype -> QIR dtype name."""
CHUNK = 64 * 2**20
"""Bytes read (and hashed) per read call."""
WINDOW_BYTES = 256 * 2**20
"""Source bytes in flight per streaming job (beyond the largest tensor, which may always be alone)."""


class Stopped(Exception):
    """The reading was stopped from another thread (the capture beside it failed or was interrupted)."""


class NotStreamable(Exception):
    """This source needs the in-memory frontend (the reason is recorded in the provenance)."""


@dataclass(frozen=True)
class SourceTensor:
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


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
    float64 exactly), read from the shard on demand."""

    def __init__(self, root: Path, tensors: dict[str, SourceTensor]) -> None:
        self.root, self.tensors = root, tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        return read_tensor(self.root, t)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of a weight, reading only their bytes (``parity_rows.RowSource``)."""
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


def read_tensor(root: Path, t: SourceTensor) -> torch.Tensor:
    with (root / t.file).open("rb") as fh:
        fh.seek(t.offset)
        data = bytearray(fh.read(t.nbytes))
    return as_tensor(data, t)


def as_tensor(data: bytearray, t: SourceTensor) -> torch.Tensor:
    if not data:
        return torch.empty(t.shape, dtype=ST_TORCH[t.dtype])
    return torch.frombuffer(data, dtype=ST_TORCH[t.dtype]).reshape(t.shape)


def source_tensors(root: Path) -> dict[str, list[SourceTensor]]:
    """Shard file -> its tensors in file order (the headers were gated by ``checkpoint_inventory``)."""
    from qcompiler.backends.safetensors.container import open_file
    from qcompiler.backends.safetensors.source import resolved, shard_names

    out: dict[str, list[SourceTensor]] = {}
    for file in shard_names(root):
        f = open_file(resolved(root, file))
        entries = sorted(f.tensors.values(), key=lambda e: e.begin)
        out[file] = [SourceTensor(file, e.name, e.dtype, e.shape, f.data_start + e.begin, e.nbytes) for e in entries]
    return out


WeightHook = Callable[[str, nn.Module, Mapping[str, BlobRef], Mapping[str, np.ndarray], torch.Tensor], None]
"""Called by the worker that quantized a weight, while it holds it: ``(name, quantized module, its
buffers' references by buffer name, the buffers' arrays, the float weight)``; the compile freezes
and packs it there (``passes/ahead.py``)."""


def quantize_job(
    t: SourceTensor,
    data: bytearray,
    scheme: str,
    template: nn.Module,
    scales: str,
    ahead: WeightHook | None = None,
) -> dict[str, Any]:
    """Quantize one source weight; returns its buffers' blob refs and the quantized module."""
    from qcompiler.quant.modules import quantize_module

    weight = as_tensor(data, t)
    new = quantize_module(with_weight(template, weight), scheme, torch.float32, scales)
    refs: dict[str, BlobRef] = {}
    own: dict[str, BlobRef] = {}
    arrays: dict[str, np.ndarray] = {}
    for sub in new.modules():
        for bname, b in list(sub._buffers.items()):
            if b is not None:
                arr, dtype = to_numpy(b)
                refs[f"{t.name}.{bname}"] = own[bname] = put_array(arr, DTYPES[dtype])
                arrays[bname] = arr
                sub._buffers[bname] = b.to("meta")  # the codes live in the blob store from here on
    if ahead is not None:
        ahead(t.name, new, own, arrays, weight)
    return {"refs": refs, "module": new}


def dense_job(t: SourceTensor, data: bytearray) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    ref = BlobRef(DTYPES[ST_IR[t.dtype]], t.shape, digest, f"safetensors:{t.file}#{t.name}")
    return {"refs": {t.name: ref}}


def stream_tensors(
    root: Path,
    shards: dict[str, list[SourceTensor]],
    job: Callable[[SourceTensor, bytearray], dict[str, Any]],
    jobs: int,
    advance: Callable[[int], None],
    stop: threading.Event | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Read every shard front to back (file sha256 as it goes) and run ``job`` on each tensor in a pool
    of ``jobs`` workers, at most ``2 * jobs`` tensors resident and, beyond the first, no more bytes than
    the largest tensor or ``WINDOW_BYTES`` per job (a 1 GB embedding is quantized alone, not beside the
    head); results in file order. ``stop`` (set by another thread) ends the reading at the next tensor
    with ``Stopped``."""
    largest = max((t.nbytes for ts in shards.values() for t in ts), default=0)
    window = ByteWindow(max(largest, WINDOW_BYTES * jobs), 2 * max(jobs, 1))
    results: list[Future[dict[str, Any]]] = []
    digests: dict[str, str] = {}

    def run(t: SourceTensor, data: bytearray) -> dict[str, Any]:
        try:
            return job(t, data)
        finally:
            release_free_pages()  # what the tensor's work freed, past the slack (qcompiler/heap.py)
            advance(t.nbytes)
            window.release(t.nbytes)

    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        for file, tensors in shards.items():
            h = hashlib.sha256()
            with (root / file).open("rb") as fh:
                pos = 0
                for t in tensors:
                    check()  # a recorded SIGINT/SIGTERM (qcompiler/interrupt.py)
                    if stop is not None and stop.is_set():
                        raise Stopped(f"stopped before {t.name}")
                    if t.offset > pos:
                        h.update(fh.read(t.offset - pos))
                    window.acquire(t.nbytes)
                    data = bytearray(t.nbytes)
                    view = memoryview(data)
                    got = 0
                    while got < t.nbytes:
                        n = fh.readinto(view[got : got + CHUNK])
                        if not n:
                            from qcompiler.frontend.weights_gate import SourceError

                            raise SourceError(
                                "file truncated while it was read", file=str(root / file), tensor=t.name,
                                expected=f"{t.nbytes} bytes", found=f"{got} bytes",
                            )  # fmt: skip
                        got += n
                    h.update(data)
                    pos = t.offset + t.nbytes
                    results.append(pool.submit(run, t, data))
                    del data, view
                h.update(fh.read())
            digests[file] = h.hexdigest()
        return [f.result() for f in results], digests


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


def prepare_hf_dir(
    path: Path, scheme: str | None, *, embeddings: bool = False, scales: str = "f32", stand_ins: bool = False
) -> Prepared:
    """Steps 1-2 of the module docstring; with ``stand_ins``, each planned module is replaced by its
    stand-in, so the model can be exported while ``stream_prepared`` reads the weights."""
    from qcompiler.frontend.hf_dir import check_source, guarded
    from qcompiler.frontend.source_info import checkpoint_state, tied_aliases, used_modules
    from qcompiler.quant.modules import quantize_plan, swap_module

    auto, cfg, _ = check_source(path)

    def build() -> Any:
        return auto.from_config(cfg, dtype=torch.float32)

    model, mode = guarded(path, "build this model from config.json", lambda: fake_model(build))
    buffers = guarded(path, "build this model's buffers", lambda: real_buffers(build))
    state_names = list(checkpoint_state(model))
    cap = wrap_hf(model.eval(), path.name)
    cap.provenance["source_dir"] = path.name
    plan: dict[str, str] = {}
    if scheme:
        with mode:
            used = used_modules(cap.module, cap.inputs)
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
        made = {
            fqn: stand_in(templates[w], plan[fqn], dtypes[w], scales, mode) if w in dtypes else None
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

    def job(t: SourceTensor, data: bytearray) -> dict[str, Any]:
        template = p.templates.get(t.name)
        if template is None:
            return dense_job(t, data)
        fqn = PREFIX + t.name.removesuffix(".weight")
        return {"fqn": fqn, **quantize_job(t, data, p.plan[fqn], template, p.scales, ahead)}

    total = sum(t.nbytes for ts in p.shards.values() for t in ts)
    advance: Advance = progress(total) if progress is not None else (lambda n: None)  # pyright: ignore[reportUnknownLambdaType]
    results, digests = stream_tensors(p.path, p.shards, job, jobs, advance, stop)
    refs: dict[str, BlobRef] = {}
    held = bool(p.stand_ins)
    for r in results:
        refs.update(r["refs"])
        if "module" in r:
            stand = p.stand_ins.get(r["fqn"])
            held = held and stand is not None and same_module(stand, r["module"])
    floats = FloatWeights(p.path, {t.name: t for ts in p.shards.values() for t in ts if t.name in p.templates})
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
