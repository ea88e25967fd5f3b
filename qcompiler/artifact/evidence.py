"""Parity evidence gathered on a reopened artifact, before it is published (kept in the manifest).

Rungs 1-3 run on the module the production reader rebuilt from the artifact's own bytes:

1. pack/unpack of every weight's codes through its layout;
2. reference reconstruction: the artifact's decode equals, bit for bit, the weights the model used
   (``effective``), or, when those are not at hand (``qcompiler opt``), the decode of the module
   that was emitted; the digest of every decode (``decode_digest``) is recorded so ``qcompiler
   verify`` can re-prove rung 2 later from the artifact alone;
3. operator errors per quantized linear: kernel error apart from quantization error;

and a **graph probe**: the graph run by the reference interpreter on a fixed, seeded input, recorded
as a few random projections of its output (``graph_probe``). ``qcompiler verify`` runs the graph in
``graph.qir`` again and requires the same projections, so an edit of the graph's semantics (an op, a
constant, an epsilon, an attribute) that the tensor hashes cannot see is refused even after the
manifest's ``files`` were re-hashed.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np
import torch

from qcompiler.decode_digest import DECODE_DIGEST
from qcompiler.ir.core import Module
from qcompiler.ir.interpret import run_graph
from qcompiler.ir.ops.dense import Embedding
from qcompiler.ir.ops.quant import QEmbedding
from qcompiler.ir.printer import print_module
from qcompiler.ir.types import DenseType
from qcompiler.ladder import Ladder, ladder
from qcompiler.proofs import Proofs

T = TypeVar("T")

PROBE_IDS = [[5, 17, 99, 3, 42, 7], [3, 99, 17, 5, 1, 0]]
"""Token ids of the probe (taken modulo the vocabulary); the second row is padded for encoders."""
PROBE_SEED = 20261201
PROBE_PROJECTIONS = 8
PROBE_TOLERANCE = 1e-5
"""Relative agreement the probe requires: float32 arithmetic of the same graph on another machine or
thread count differs by less than 1e-6 (measured: 0 across thread counts here); an edit of the
graph's meaning moves it more (a 4% change of one attention scale in a random 2-layer BERT: 1e-4)."""


def gather(
    m: Module,
    effective: Mapping[str, torch.Tensor | np.ndarray],
    float_weights: Mapping[str, torch.Tensor] | None = None,
    *,
    jobs: int = 1,
    proofs: Proofs | None = None,
    probe_of: Callable[[Module], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """Rungs 1-3 on ``m`` (a reopened artifact) as a JSON-able record; ``ok`` is false on any failure.
    Weight by weight (``parity.ladder``, ``jobs`` threads): each decode is made once and dropped;
    a weight the compile's ``proofs`` cover on the same bytes is not decoded again. ``probe_of``:
    the graph probe (default ``graph_probe``; a ``ProbeAhead`` started before the files were written)."""
    rungs, probe = beside_the_ladder(probe_of or graph_probe, m, effective, float_weights, jobs, proofs)
    r1, r2, r3 = rungs.r1, rungs.r2, rungs.r3
    failures = [f"rung {r.rung} {r.tensor}: {r.detail}" for r in r1 + r2 if not r.ok]
    if probe is not None and not all(math.isfinite(v) for v in [probe["norm"], *probe["projections"]]):
        failures.append("graph probe: the graph's output on the probe input is not finite (NaN or infinity)")
        probe = None
    return {
        "ok": not failures,
        "failures": failures,
        "rung1_pack_unpack": {"weights": len(r1), "passed": sum(r.ok for r in r1)},
        "rung2_reconstruction": {
            "weights": len(r2),
            "bit_exact": sum(r.ok for r in r2),
            "reference": getattr(effective, "label", "source effective weights" if effective else "emitted module"),
            DECODE_DIGEST: rungs.decode_digests,
        },
        "rung3_operators": {r.tensor: {k: float(v) for k, v in r.metrics.items()} for r in r3},
        **({"graph_probe": probe} if probe is not None else {}),
    }


def beside_the_ladder(
    probe: Callable[[Module], T],
    m: Module,
    effective: Mapping[str, torch.Tensor | np.ndarray] | None,
    float_weights: Mapping[str, torch.Tensor] | None,
    jobs: int,
    proofs: Proofs | None = None,
    digest: str = DECODE_DIGEST,
) -> tuple[Ladder, T]:
    """``ladder(m, ...)`` and ``probe(m)``; with more than one job the probe runs beside the ladder,
    in a thread of its own: both only read the artifact, and the ladder alone leaves a core idle part
    of the time (a 1.1B compile: ladder then probe 9.2-10.1 s, side by side 7.9 s). An error of
    either is raised once both are done. ``digest``: the decode digest the ladder computes."""
    if jobs <= 1:
        return ladder(m, effective, float_weights, jobs=jobs, proofs=proofs, digest=digest), probe(m)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="qc-probe") as pool:
        probing = pool.submit(probe, m)
        try:
            rungs = ladder(m, effective, float_weights, jobs=jobs, proofs=proofs, digest=digest)
        finally:
            wait([probing])
        return rungs, probing.result()


class ProbeAhead:
    """The graph probe of a module about to be written, run in a thread of its own while its files
    are written and reopened (a 1.1B model: 2-3 s of the reference interpreter, beside writing and
    hashing 0.8 GB). Called with the reopened module, it gives that result when both print alike,
    tensor locations aside (``graph_text``): the same graph over tensors of the same sha256s, which
    the production reader checked against the artifact's bytes. Otherwise the probe runs again on
    the reopened module."""

    def __init__(self, m: Module) -> None:
        self.text = graph_text(m)
        self.result: dict[str, Any] | None = None
        self.failed = False
        self.thread = threading.Thread(target=self.run, args=(m,), name="qc-probe-ahead", daemon=True)
        self.thread.start()

    def run(self, m: Module) -> None:
        try:
            self.result = graph_probe(m)
        except BaseException:  # the reopened module is probed again, and raises there
            self.failed = True

    def __call__(self, reopened: Module) -> dict[str, Any] | None:
        self.thread.join()
        if not self.failed and graph_text(reopened) == self.text:
            return self.result
        return graph_probe(reopened)


def graph_text(m: Module) -> str:
    """What the graph probe of ``m`` depends on, as text: its graphs, types and tensor sha256s (not
    the tensors' locations, nor the module's attributes, which the interpreter does not read and the
    backends add records to)."""
    tensors = {n: dataclasses.replace(d, blob=dataclasses.replace(d.blob, location="")) for n, d in m.tensors.items()}
    return print_module(dataclasses.replace(m, tensors=tensors, attrs={}))


def probe_inputs(m: Module, rows: list[list[int]] | None = None) -> list[torch.Tensor] | None:
    """The probe's inputs for a token model (``input_ids`` or ``input_ids, attention_mask``, both
    integer ``[batch, seq]``; ``rows``: the ids, default ``PROBE_IDS``, taken modulo the vocabulary,
    the second row's last two tokens masked), or ``None`` for a graph that does not take token ids."""
    g = m.graphs[0]
    args = g.args
    ints = [a for a in args if isinstance(a.type, DenseType) and a.type.dtype.name in ("i64", "i32")]
    if not args or len(ints) != len(args) or len(args) > 2 or any(a.type.rank != 2 for a in ints):
        return None
    vocab = next(
        (int(op.w.type.shape[0]) for op in g.ops if isinstance(op, Embedding | QEmbedding) and op.ids is args[0]),
        None,
    )
    if vocab is None:
        return None
    ids = torch.tensor(PROBE_IDS if rows is None else rows, dtype=torch.int64) % vocab
    if len(args) == 1:
        return [ids]
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return [ids, mask]


def graph_probe(m: Module) -> dict[str, Any] | None:
    """The probe record (see the module docstring): output norm and seeded random projections."""
    inputs = probe_inputs(m)
    if inputs is None:
        return None
    out = run_graph(m, inputs)[0].detach().double().flatten()
    gen = torch.Generator().manual_seed(PROBE_SEED)
    directions = torch.randn(PROBE_PROJECTIONS, out.numel(), generator=gen, dtype=torch.float64)
    projections = (directions @ out) / max(out.numel(), 1) ** 0.5
    return {
        "inputs": "PROBE_IDS",
        "norm": float(out.norm()),
        "projections": [float(v) for v in projections],
        "tolerance": PROBE_TOLERANCE,
    }


def finite(v: object) -> float | None:
    """``v`` as a finite float, or ``None`` (not a number, an int beyond float, NaN or infinity)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def probe_failures(m: Module, recorded: object) -> list[str]:
    """What differs between the graph's probe now and the one recorded at compile time."""
    now = graph_probe(m)
    if now is None and recorded is None:
        return []
    if now is None or not isinstance(recorded, dict):
        return ["the graph probe was not recorded" if now is not None else "the graph no longer takes token ids"]
    rec: dict[str, Any] = recorded
    want, norm = rec.get("projections"), rec.get("norm")
    if not isinstance(want, list) or len(want) != PROBE_PROJECTIONS or not isinstance(norm, int | float):
        return ["the recorded graph probe is malformed"]
    values = [f for f in (finite(v) for v in [*want, norm]) if f is not None]
    if len(values) != PROBE_PROJECTIONS + 1:
        return ["the recorded graph probe is malformed"]
    got = torch.tensor(now["projections"], dtype=torch.float64)
    ref, ref_norm = torch.tensor(values[:-1], dtype=torch.float64), values[-1]
    scale = max(float(ref.norm()), ref_norm * 1e-3, 1e-30)
    rel = float((got - ref).norm()) / scale
    rel_norm = abs(now["norm"] - ref_norm) / max(abs(ref_norm), 1e-30)
    if not (rel <= PROBE_TOLERANCE and rel_norm <= PROBE_TOLERANCE):  # written so that a NaN fails
        return [f"graph output moved (projections rel {rel:.2e}, norm rel {rel_norm:.2e}; tolerance {PROBE_TOLERANCE})"]
    return []
