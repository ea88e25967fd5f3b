"""``qcompiler.load(path, device="cpu", fallback="forbid")``: an artifact, reopened as untrusted input,
admitted op by op to kernels, materialised, and checked before it runs.

Stages, each timed into ``LoadedModel.timeline`` (seconds):

1. ``discover``: the path is a directory with a manifest (nothing else is read yet);
2. ``parse``: ``manifest.json`` parsed within its size bound (the reader parses it again, gated);
3. ``verify``: ``open_artifact``, the production reader: container gates, semantic gates and
   ``graph.qir`` (tensors resolved into the container's bytes, sha256 checked);
4. ``place``: the artifact's topology must be one this device runs (tp = pp = 1 on the CPU), then
   every ``q.linear``/``q.embedding`` (and any ``q.dequantize`` left in the graph) is admitted to a
   kernel for the prefill and the decode phase: each kernel of ``registry()`` accepted or rejected with
   its reason, the first accepted selected (``DispatchDecision``). ``fallback="forbid"`` refuses to
   load when any op would need the full-dequant fallback, naming the ops; ``"warn"`` warns with the
   fallback fraction of weighted work (multiply-adds); ``"allow"`` loads silently (the trace says so);
5. ``read``: the codes and qparams unpacked from the container's layout, and dense tensors read;
6. ``transfer``: copies to the device (none on the CPU: recorded as measured, about 0);
7. ``repack``: each selected kernel prepares its weight (a repack only where it declares one);
8. ``warmup``: every selected kernel runs once on a seeded input against a float64 decode, within its
   ``error_bound`` (the load's self-check).

``LoadedModel.memory`` is the memory ledger: disk, mapped container bytes, resident kernel buffers
(packed, repacked, fallback dense buffers, apart), resident dense tensors, device bytes (0 on the
CPU), and (after ``Session.generate``) the runtime workspace and the KV cache.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from qcompiler.artifact.reader import open_artifact, read_json
from qcompiler.artifact.request import OpenedArtifact
from qcompiler.backends import get_backend
from qcompiler.errors import UsageError
from qcompiler.ir.core import Graph, Module, Op, narrow
from qcompiler.ir.interpret import TORCH, Env
from qcompiler.ir.ops.dense import Const
from qcompiler.ir.ops.quant import weight_name
from qcompiler.ir.types import QuantType
from qcompiler.parity import decoded
from qcompiler.runtime.cpu_kernels import PARTS, affine_parts
from qcompiler.runtime.kernels import (
    KernelSpec,
    Place,
    Signature,
    admit,
    quantized_ops,
    registry,
    signature,
)
from qcompiler.runtime.places import COMPUTES, LoadError, resolve_compute, resolve_place

Fallback = Literal["forbid", "warn", "allow"]
PHASES = ("prefill", "decode")


@dataclass
class DispatchDecision:
    """One op in one phase: its signature, every candidate with its verdict, and the kernel chosen."""

    op: str
    weight: str
    phase: str
    signature: Signature
    candidates: list[tuple[str, bool, str]]
    selected: str
    kind: str
    repack: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "weight": self.weight,
            "phase": self.phase,
            "signature": {k: v for k, v in vars(self.signature).items() if k not in ("name",)},
            "candidates": [{"kernel": k, "accepted": ok, "reason": why} for k, ok, why in self.candidates],
            "selected": self.selected,
            "kind": self.kind,
            "repack": self.repack or None,
        }


@dataclass
class LoadedModel:
    path: Path
    opened: OpenedArtifact
    device: str
    fallback: Fallback
    place: Place = field(default_factory=Place)
    decisions: list[DispatchDecision] = field(default_factory=list[DispatchDecision])
    handles: dict[tuple[str, str], Any] = field(default_factory=dict[tuple[str, str], Any])
    """(weight name, kernel id) -> the kernel's prepared weight."""
    timeline: dict[str, float] = field(default_factory=dict[str, float])
    memory: dict[str, int] = field(default_factory=dict[str, int])
    self_check: dict[str, float] = field(default_factory=dict[str, float])
    constants: dict[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])
    """Dense tensors (norms, embeddings, rotary tables), read once at materialisation and kept resident."""

    def constant(self, env: Env, op: Op) -> torch.Tensor:
        ref = narrow(op, Const).ref
        name = str(ref).removeprefix("@")
        if name not in self.constants:
            self.constants[name] = env.tensor(ref).to(self.place.torch_device)
        return self.constants[name]

    @property
    def compute(self) -> str:
        """The narrowest activation dtype this load's kernels may compute in (``f32`` or ``bf16``)."""
        return self.place.compute

    @property
    def module(self) -> Module:
        return self.opened.module

    @property
    def graph(self) -> Graph:
        return self.opened.module.graphs[0]

    def decision(self, weight: str, phase: str) -> DispatchDecision:
        return next(d for d in self.decisions if d.weight == weight and d.phase == phase)

    def fallback_fraction(self, phase: str = "prefill") -> float:
        ds = [d for d in self.decisions if d.phase == phase]
        total = sum(d.signature.work for d in ds) or 1
        return sum(d.signature.work for d in ds if d.kind == "fallback") / total

    def loaded_bits_per_weight(self) -> float:
        """The rate ledger's ``loaded memory`` scope: kernel buffers (packed, repacked, fallback) in bits over
        the quantized weights' parameters."""
        params = sum(d.signature.n * d.signature.k for d in self.decisions if d.phase == "prefill")
        held = sum(tensor_bytes(h) for h in unique_handles(self).values())
        return 8 * held / params if params else 0.0

    def trace(self) -> list[dict[str, Any]]:
        return [d.as_dict() for d in self.decisions]


@contextmanager
def stage(timeline: dict[str, float], name: str) -> Generator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timeline[name] = timeline.get(name, 0.0) + time.perf_counter() - start


def decide(op: Op, w: Op, t: QuantType, phase: str, place: Place, kernels: str) -> DispatchDecision:
    sig = signature(op, t, phase, place) if op.name != "q.dequantize" else None
    name = weight_name(w)
    candidates: list[tuple[str, bool, str]] = []
    chosen: KernelSpec | None = None
    for k in registry():
        if sig is None:  # a dequantize left in the graph: only a dense buffer serves it
            ok = k.kind == "fallback" and k.op == "q.linear" and k.device == place.device
            why = "a dense weight is needed"
        elif k.kind == "reference" and kernels != "reference":
            ok, why = False, "reference kernels run only when asked for (kernels='reference')"
        else:
            ok, why = admit(k, sig, t, place)
        candidates.append((k.id, ok, why))
        if ok and chosen is None:
            chosen = k
    if chosen is None:
        reasons = "; ".join(f"{k}: {r}" for k, _, r in candidates)
        raise LoadError(f"{op.name} of {name}: no kernel accepts it ({reasons})")
    if sig is None:
        n, k_dim = (int(d) for d in t.shape)
        sig = Signature(
            "q.dequantize", name, t.family, t.pack.family, t.code.dtype.name, False, "", 0, 1, "", "", n, k_dim, False
        )
    return DispatchDecision(op.name, name, phase, sig, candidates, chosen.id, chosen.kind, chosen.repack)


def kernel(kid: str) -> KernelSpec:
    return next(k for k in registry() if k.id == kid)


def read_dense(lm: LoadedModel) -> None:
    """Read the dense tensors once (they stay resident)."""
    env = Env(lm.module)
    for op in lm.graph.ops:
        if op.name == "const":
            lm.constant(env, op)


def read_weight(lm: LoadedModel, name: str, w: Op, t: QuantType) -> None:
    """Unpack ``name``'s codes and qparams when a packed kernel reads them unpacked (shared by its kernels'
    ``prepare`` and the self-check, then dropped)."""
    if any(d.kind == "packed" and kernel(d.selected).layouts is None for d in lm.decisions if d.weight == name):
        affine_parts(lm.module, w, t)


def place(lm: LoadedModel) -> None:
    topo = (lm.opened.manifest or {}).get("topology", {})
    tp, pp = (int(topo.get(k, 1)) if isinstance(topo, dict) else 1 for k in ("tp", "pp"))
    if (tp, pp) != (1, 1):
        raise LoadError(f"topology tp={tp}, pp={pp}: the runtime runs tp=1, pp=1 only")


def materialize(lm: LoadedModel, name: str, w: Op, t: QuantType, shared: dict[tuple[str, str], Any]) -> None:
    """Prepare ``name``'s weight for each kernel selected for it (kernels that share buffers, once)."""
    for d in lm.decisions:
        key = (d.weight, d.selected)
        if d.weight != name or key in lm.handles:
            continue
        k = kernel(d.selected)
        common = (d.weight, k.shares or k.id)
        if common not in shared:
            assert k.prepare is not None
            shared[common] = k.prepare(lm.module, w, t, lm.place)
        lm.handles[key] = shared[common]


def per_weight(lm: LoadedModel, ops: list[tuple[Op, Op, QuantType]]) -> None:
    """Read, repack and self-check one weight at a time, so the unpacked codes of only one are held."""
    shared: dict[tuple[str, str], Any] = {}
    gen, done = torch.Generator().manual_seed(0), set[tuple[str, str]]()
    by_weight: dict[str, list[tuple[Op, Op, QuantType]]] = {}
    for x in ops:
        by_weight.setdefault(weight_name(x[1]), []).append(x)
    for name, readers in by_weight.items():
        _, w, t = readers[0]
        with stage(lm.timeline, "read"):
            read_weight(lm, name, w, t)
        with stage(lm.timeline, "repack"):
            materialize(lm, name, w, t, shared)  # the prepared weights land on the device
        with stage(lm.timeline, "warmup"):
            check(lm, readers, gen, done)
        PARTS.clear()


def unique_handles(lm: LoadedModel) -> dict[tuple[str, str], Any]:
    """``lm.handles`` with each prepared weight once (kernels that share buffers hold one)."""
    seen: set[int] = set()
    out: dict[tuple[str, str], Any] = {}
    for key, h in lm.handles.items():
        if id(h) not in seen:
            seen.add(id(h))
            out[key] = h
    return out


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())  # pyright: ignore[reportUnknownArgumentType, reportUnknownVariableType]
    return 0


def memory_ledger(lm: LoadedModel) -> dict[str, int]:
    files = [p for p in lm.path.iterdir() if p.is_file()]
    container = [p for p in files if p.name not in ("manifest.json", "graph.qir")]
    by_kind: dict[str, int] = {"packed": 0, "repacked": 0, "fallback": 0, "reference": 0}
    for (_, kid), h in unique_handles(lm).items():
        k = kernel(kid)
        by_kind["repacked" if k.kind == "packed" and k.repack else k.kind] += tensor_bytes(h)
    on_device = lm.place.torch_device.type != "cpu"
    return {
        "disk": sum(p.stat().st_size for p in files),
        "mapped": sum(p.stat().st_size for p in container),
        "resident_kernel_buffers": by_kind["packed"],
        "repack_buffers": by_kind["repacked"],
        "fallback_buffers": by_kind["fallback"],
        "reference_buffers": by_kind["reference"],
        "resident_dense_tensors": sum(tensor_bytes(t) for t in lm.constants.values()),
        "device": sum(by_kind.values()) + sum(tensor_bytes(t) for t in lm.constants.values()) if on_device else 0,
        "runtime_workspace": 0,
        "kv_cache": 0,
    }


def check(
    lm: LoadedModel, ops: list[tuple[Op, Op, QuantType]], gen: torch.Generator, done: set[tuple[str, str]]
) -> None:
    """Each prefill decision's kernel on a seeded input, against the float64 reference decode (the reference
    decoder's own reading of the stored tensors, so a kernel that misreads a scale dtype is caught here)."""
    dev = lm.place.torch_device
    for op, w, t in ops:
        d = lm.decision(weight_name(w), "prefill")
        if (d.weight, d.selected) in done or op.name == "q.dequantize":
            continue
        done.add((d.weight, d.selected))
        k = kernel(d.selected)
        assert k.run is not None
        ref_w = torch.from_numpy(decoded(lm.module, w, t)).double()  # the reference decoder: not the kernels' reads
        h = lm.handles[(d.weight, d.selected)]
        if op.name == "q.linear":
            x = torch.randn(3, int(t.shape[1]), generator=gen).to(TORCH.get(d.signature.activation, torch.float32))
            bias = torch.randn(int(t.shape[0]), generator=gen).to(x.dtype) if d.signature.bias else None
            got = k.run(h, x.to(dev), None if bias is None else bias.to(dev)).cpu().double()
            want = x.double() @ ref_w.T + (0 if bias is None else bias.double())
        else:
            ids = torch.randint(0, int(t.shape[0]), (3, 5), generator=gen)
            got, want = k.run(h, ids.to(dev), None).cpu().double(), ref_w[ids]
        err = float((got - want).norm() / max(float(want.norm()), 1e-30))
        lm.self_check[d.weight] = err
        if err > k.error_bound:
            raise LoadError(f"self-check: {d.weight} on {k.id}: relative error {err:.2e} > bound {k.error_bound:.0e}")


def load(
    path: Path | str, device: str = "cpu", fallback: Fallback = "forbid", kernels: str = "auto", compute: str = "auto"
) -> LoadedModel:
    """Load an artifact for execution (see the module docstring). ``compute``: the narrowest activation
    dtype a kernel may compute in (``f32``: the graph's own, exact; ``bf16``: the bf16 kernels and their
    stated bound; ``auto``: ``bf16`` for a model whose source dtype was bf16, else ``f32``)."""
    if fallback not in ("forbid", "warn", "allow"):
        raise UsageError(f"fallback must be forbid, warn or allow, not {fallback!r}")
    if compute not in COMPUTES:
        raise UsageError(f"compute must be one of {', '.join(COMPUTES)}, not {compute!r}")
    timeline: dict[str, float] = {}
    root = Path(path)
    with stage(timeline, "discover"):
        if not (root / "manifest.json").is_file():
            raise LoadError(f"{root}: not an artifact directory (no manifest.json)")
    with stage(timeline, "parse"):
        read_json(root, "manifest.json")
    with stage(timeline, "verify"):
        opened = open_artifact(root)
    where = replace(resolve_place(device, opened), compute=resolve_compute(compute, opened, device))
    lm = LoadedModel(root, opened, device, fallback, place=where, timeline=timeline)
    ops = list(quantized_ops(lm.graph))
    with stage(timeline, "place"):
        place(lm)
        get_backend(opened.target).runtime_kernels(opened)
        lm.decisions = [decide(op, w, t, phase, lm.place, kernels) for op, w, t in ops for phase in PHASES]
    falling = sorted({f"{d.op} {d.weight}" for d in lm.decisions if d.kind == "fallback"})
    if falling and fallback == "forbid":
        raise LoadError(
            f"fallback='forbid': {len(falling)} op(s) have no packed kernel and would run on a dense dequantized "
            f"weight: {', '.join(falling[:4])}{' ...' if len(falling) > 4 else ''} "
            f"(fallback fraction {lm.fallback_fraction():.1%} of weighted work)"
        )
    if falling and fallback == "warn":
        warnings.warn(
            f"{len(falling)} op(s) run on the full-dequant fallback: {lm.fallback_fraction():.1%} of weighted work",
            stacklevel=2,
        )
    try:
        with stage(timeline, "read"):
            read_dense(lm)
        with stage(timeline, "transfer"):
            for name in list(lm.constants):
                lm.constants[name] = lm.constants[name].to(lm.place.torch_device)  # CPU: nothing moves
        for key in ("repack", "warmup"):
            timeline[key] = 0.0
        per_weight(lm, ops)
    finally:
        PARTS.clear()
    lm.memory = memory_ledger(lm)
    return lm
