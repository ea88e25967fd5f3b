"""Parity rungs 4 and 5, on a loaded artifact (``qcompiler verify PATH --level 5``).

- **Rung 4, graph and logits.** The runtime (selected kernels, KV cache) against the reference
  interpreter on the same graph, which runs once:

  1. the runtime decodes 16 greedy tokens after a seeded prompt (``Session.generate``);
  2. the reference runs once on the whole sequence, the prompt and every generated token but the last
     (teacher forcing on the runtime's tokens), keeping every value by name;
  3. the runtime runs that sequence as one prefill step; every quantized linear's output and the
     logits are compared with the reference's;
  4. each generated step's logits (decoded with the KV cache) are compared with the reference's at
     its position, and each token is the reference's argmax there, or a near tie (``token_verdict``).

  The bound (``graph_bound``) is the selected kernels' largest stated error bound times the square root
  of the number of quantized linears on the longest path to the output.
- **Rung 5, dispatch and resources.**
  - Every quantized op runs a packed kernel, unless the fallback policy allows otherwise, and the
    fallback count matches the policy.
  - No persistent full-weight dequantized buffer exists without a fallback decision.
  - The resident bytes equal the memory ledger.
  - Repacks happen only in kernels that declare one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from qcompiler.ir.core import Graph, Module
from qcompiler.ir.interpret import run_graph
from qcompiler.ir.kv import causal_lm_dims
from qcompiler.runtime.execute import Session
from qcompiler.runtime.load import LoadedModel, kernel, memory_ledger

PROMPT = [[5, 17, 99, 3], [3, 99, 17, 5]]
TOKENS = 16


def reference_values(m: Module, g: Graph, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every value of the reference interpreter's run, by result name (``return``: the first output)."""
    named: dict[str, torch.Tensor] = {}
    named["return"] = run_graph(m, inputs, g.name, named)[0]
    return named


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def inputs_for(lm: LoadedModel) -> list[torch.Tensor]:
    ids = torch.tensor(PROMPT, dtype=torch.int64)
    return [ids] if causal_lm_dims(lm.graph) is not None else [ids, torch.ones_like(ids)]


def linear_depth(g: Graph, dense: bool = False) -> int:
    """The most ``q.linear`` ops (and with ``dense``, ``linear`` ops too) on one data-flow path from an input
    to the first output. Under bf16 compute the plan runs a dense linear whose weight is stored in bf16 (a
    bf16 model's ``lm_head``) in bf16, so its rounding joins the path."""
    counted = {"q.linear", "linear"} if dense else {"q.linear"}
    depth: dict[int, int] = {}
    for op in g.ops:
        d = max((depth.get(id(v), 0) for v in op.operands), default=0)
        if op.name == "return":
            return depth.get(id(op.operands[0]), 0) if op.operands else 0
        depth[id(op.result)] = d + (op.name in counted)
    return 0


def graph_bound(kernel_bound: float, depth: int) -> float:
    """What rung 4 compares layer outputs and logits against: ``kernel_bound`` (the selected kernels'
    largest stated bound) times ``sqrt(depth)``, for ``depth`` linears on the longest path (``linear_depth``).
    Each op's rounding differs from the reference's independently, and independent errors add in quadrature
    along the path (measured: per-op error x sqrt(depth) predicts the deepest layer's error, f32 and bf16)."""
    return kernel_bound * math.sqrt(max(depth, 1))


@dataclass(frozen=True)
class Verdict:
    """One generated token against the reference logits at its position."""

    kind: str
    """``equal``, ``near tie`` (excused) or ``mismatch``."""
    reference: int
    margin: float
    """The reference's logit of its argmax minus its logit of our token (0 when equal)."""
    allowed: float
    """``sqrt(2) * bound * ||reference row||``: the most a relative L2 error of ``bound`` moves two logits apart."""
    rel: float


def token_verdict(ours: torch.Tensor, ref: torch.Tensor, token: int, bound: float) -> Verdict:
    """Our ``token`` (chosen from our logits row ``ours``) against the reference logits row ``ref``.
    A token that is not the reference's argmax is excused as a near tie only when our row is within
    ``bound`` of the reference's (relative L2) and the reference's margin between its argmax and our
    token is at most ``sqrt(2) * bound * ||ref||``: an error ``e`` with ``||e|| <= bound * ||ref||``
    moves two logits apart by at most ``|e_i| + |e_j| <= sqrt(2) * ||e||``."""
    r = ref.detach().cpu().double()
    want = int(r.argmax())
    allowed = math.sqrt(2) * bound * float(r.norm())
    err = rel(ours, r)
    if token == want:
        return Verdict("equal", want, 0.0, allowed, err)
    margin = float(r[want] - r[token])
    kind = "near tie" if err <= bound and margin <= allowed else "mismatch"
    return Verdict(kind, want, margin, allowed, err)


def rung4(lm: LoadedModel) -> dict[str, Any]:
    kernel_bound = max((kernel(d.selected).error_bound for d in lm.decisions), default=1e-5)
    depth = linear_depth(lm.graph, dense=lm.compute == "bf16")
    bound = graph_bound(kernel_bound, depth)
    causal = causal_lm_dims(lm.graph) is not None
    inputs = inputs_for(lm)
    tokens: list[list[int]] = []
    steps: list[torch.Tensor] = []
    if causal:
        tokens, steps = Session(lm).generate(PROMPT, TOKENS)
        inputs = [torch.tensor([p + t[:-1] for p, t in zip(PROMPT, tokens, strict=True)], dtype=torch.int64)]
    ref = reference_values(lm.module, lm.graph, inputs)  # the one reference run
    ours = Session(lm).run_named(inputs)
    layers = {
        op.result.name: rel(ours[op.result.name], ref[op.result.name]) for op in lm.graph.ops if op.name == "q.linear"
    }
    out: dict[str, Any] = {
        "compute": lm.compute,
        "kernel_bound": kernel_bound,
        "linear_depth": depth,
        "bound": bound,
        "positions": int(inputs[0].shape[-1]),
        "layers": len(layers),
        "max_layer_rel": max(layers.values(), default=0.0),
        "output_rel": rel(ours["return"], ref["return"]),
    }
    failed = [n for n, e in layers.items() if e > bound]
    if out["output_rel"] > bound:
        failed.append("output")
    if causal:
        failed += greedy(out, ref["return"], tokens, steps, bound)
    out["failed"] = failed
    return out


def greedy(
    out: dict[str, Any], ref: torch.Tensor, tokens: list[list[int]], steps: list[torch.Tensor], bound: float
) -> list[str]:
    """Each step's logits and tokens against the reference's logits ``ref`` ``[batch, seq, vocab]`` at
    the step's position; fills ``out``'s greedy keys and returns what failed."""
    start = len(PROMPT[0]) - 1
    worst = 0.0
    near: list[dict[str, Any]] = []
    wrong: list[str] = []
    strict = True
    for i, logits in enumerate(steps):
        want = ref[:, start + i]
        worst = max(worst, rel(logits, want))
        for row, (ours_row, ref_row) in enumerate(zip(logits, want, strict=True)):
            v = token_verdict(ours_row, ref_row, tokens[row][i], bound)
            strict = strict and v.kind == "equal"
            where = {"row": row, "step": i, "position": start + i, "ours": tokens[row][i], "reference": v.reference}
            if v.kind == "near tie":
                near.append({**where, "margin": v.margin, "allowed": v.allowed})
            elif v.kind == "mismatch":
                wrong.append(f"row {row} step {i}: {tokens[row][i]} != {v.reference} (margin {v.margin:.2e} > "
                             f"{v.allowed:.2e} or rel {v.rel:.2e} > bound)")  # fmt: skip
    out.update(
        {
            "greedy_tokens": TOKENS,
            "greedy_equal": not wrong,
            "strict_equal": strict,
            "near_ties": {"count": len(near), "at": near},
            "greedy_max_rel": worst,
        }
    )
    failed = [f"greedy token trace ({'; '.join(wrong[:3])})"] if wrong else []
    return failed + (["greedy logits"] if worst > bound else [])


def rung5(lm: LoadedModel) -> dict[str, Any]:
    kinds = [d.kind for d in lm.decisions]
    fallbacks = kinds.count("fallback")
    ledger = memory_ledger(lm)
    failed: list[str] = []
    if lm.fallback == "forbid" and fallbacks:
        failed.append(f"{fallbacks} fallback decisions under fallback='forbid'")
    if not fallbacks and ledger["fallback_buffers"]:
        failed.append("a dense dequantized buffer exists without a fallback decision")
    if ledger != {**lm.memory, "kv_cache": 0, "runtime_workspace": 0}:
        failed.append("resident bytes differ from the memory ledger")
    undeclared = sorted(
        {d.selected for d in lm.decisions if d.kind == "packed" and not kernel(d.selected).repack and d.repack}
    )
    if undeclared:
        failed.append(f"undeclared repacks: {undeclared}")
    return {
        "kernels": sorted({d.selected for d in lm.decisions}),
        "decisions": len(kinds),
        "fallbacks": fallbacks,
        "policy": lm.fallback,
        "repacks": sorted({d.selected for d in lm.decisions if d.repack}),
        "memory": ledger,
        "failed": failed,
    }
