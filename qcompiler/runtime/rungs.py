"""Parity rungs 4 and 5, on a loaded artifact (``qcompiler verify PATH --level 5``).

- **Rung 4, graph and logits.** The runtime (selected kernels, KV cache) against the reference
  interpreter on the same graph. Every quantized linear's output is compared on a seeded prompt, and
  so are the logits (or hidden states). The bound is the kernels' stated error bound. For a causal LM,
  the greedy token trace of 16 tokens must be equal, with the logits of each step compared too.
- **Rung 5, dispatch and resources.**
  - Every quantized op runs a packed kernel, unless the fallback policy allows otherwise, and the
    fallback count matches the policy.
  - No persistent full-weight dequantized buffer exists without a fallback.
  - The resident bytes equal the memory ledger.
  - Repacks happen only in kernels that declare one.
"""

from __future__ import annotations

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


def rung4(lm: LoadedModel) -> dict[str, Any]:
    bound = max((kernel(d.selected).error_bound for d in lm.decisions), default=1e-5)
    inputs = inputs_for(lm)
    ref = reference_values(lm.module, lm.graph, inputs)
    session = Session(lm)
    ours = session.run_named(inputs)
    layers = {
        op.result.name: rel(ours[op.result.name], ref[op.result.name]) for op in lm.graph.ops if op.name == "q.linear"
    }
    out: dict[str, Any] = {
        "bound": bound,
        "layers": len(layers),
        "max_layer_rel": max(layers.values(), default=0.0),
        "output_rel": rel(ours["return"], ref["return"]),
    }
    failed = [n for n, e in layers.items() if e > bound]
    if out["output_rel"] > bound:
        failed.append("output")
    if causal_lm_dims(lm.graph) is not None:
        tokens, steps = Session(lm).generate(PROMPT, TOKENS)
        ids = torch.tensor(PROMPT, dtype=torch.int64)
        worst, equal = 0.0, True
        for i, logits in enumerate(steps):
            want = reference_values(lm.module, lm.graph, [ids])["return"][:, -1]
            worst = max(worst, rel(logits, want))
            nxt = want.argmax(-1)
            equal = equal and nxt.tolist() == [row[i] for row in tokens]
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        out.update({"greedy_tokens": TOKENS, "greedy_equal": equal, "greedy_max_rel": worst})
        if not equal:
            failed.append("greedy token trace")
        if worst > bound:
            failed.append("greedy logits")
    out["failed"] = failed
    return out


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
