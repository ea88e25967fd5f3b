"""Run a loaded model: its QIR graph lowered to an execution plan (``plan.py``: an fx GraphModule per phase
and input shape, built on first use and reused), with the kernels the loader selected.

Quantized ops run on their selected kernel (the ``prefill`` decision for a step of several tokens, the
``decode`` decision for one); dense ops are torch calls (the reference interpreter's rules where no
lowering is declared). A causal LM keeps a preallocated KV cache written in place (``kvcache.py``): each
step's keys and values land at the positions after the cached ones, and the rotary positions continue
from there. ``Session.generate`` decodes greedily; its prompt may be fed in chunks.

    lm = qcompiler.load("out/tiny-w4")
    s = Session(lm)
    tokens, steps = s.generate([[1, 2, 3]], max_new_tokens=16)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qcompiler.errors import UsageError
from qcompiler.ir.kv import causal_lm_dims
from qcompiler.runtime.kvcache import KVCache
from qcompiler.runtime.load import LoadedModel
from qcompiler.runtime.plan import Plan, build

PlanKey = tuple[str, tuple[tuple[tuple[int, ...], torch.dtype], ...], bool]


@dataclass
class Session:
    """One stream of execution over a loaded model, with its KV cache (causal LMs) and its plans."""

    lm: LoadedModel
    cache: KVCache = field(default_factory=KVCache)
    kernels_used: dict[str, set[str]] = field(default_factory=dict[str, set[str]])
    """Phase -> the kernels that ran in it."""
    plans: dict[PlanKey, Plan] = field(default_factory=dict[PlanKey, Plan])
    workspace: int = 0
    """The most bytes of intermediate values live at once in one step (each plan measures its first run)."""
    causal: bool = field(init=False)
    """A causal LM's graph (it keeps a KV cache); decided once, not per step."""

    def __post_init__(self) -> None:
        self.causal = causal_lm_dims(self.lm.graph) is not None

    @property
    def past(self) -> int:
        return self.cache.past

    def kv_bytes(self) -> int:
        return self.cache.nbytes()

    def plan(self, inputs: list[torch.Tensor], named: bool) -> tuple[Plan, str]:
        phase = "decode" if self.causal and inputs[0].shape[-1] == 1 and self.past else "prefill"
        key: PlanKey = (phase, tuple((tuple(x.shape), x.dtype) for x in inputs), named)
        if key not in self.plans:
            self.plans[key] = build(self.lm, self.cache, inputs, phase, named)
        return self.plans[key], phase

    def execute(self, inputs: list[torch.Tensor], named: bool) -> Any:
        dev = self.lm.place.torch_device
        inputs = [x.to(dev) for x in inputs]
        plan, phase = self.plan(inputs, named)
        with torch.no_grad():
            if dev.type == "cpu":
                out = plan(inputs)
            else:
                with torch.device(dev):  # factory ops in the rules make tensors on the device
                    out = plan(inputs)
        self.kernels_used.setdefault(phase, set()).update(plan.kernels)
        self.workspace = max(self.workspace, plan.workspace)
        return out

    def run(self, inputs: list[torch.Tensor], named: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """One step: the graph's outputs on ``inputs``. A causal LM's cache is written after its cached
        positions but not advanced (``step`` advances it); ``named``, when given, receives every value."""
        if named is None:
            return list(self.execute(inputs, False))
        outs, values = self.execute(inputs, True)
        named.update(values)
        return list(outs)

    def run_named(self, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step, keeping every value by result name (``return``: the first output); the cache advances."""
        named: dict[str, torch.Tensor] = {}
        named["return"] = self.run(inputs, named)[0]
        self.advance(inputs)
        return named

    def advance(self, inputs: list[torch.Tensor]) -> None:
        if self.causal:
            self.cache.past += int(inputs[0].shape[-1])

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits for ``ids`` ``[batch, new]`` after the cached tokens; the cache then holds them too."""
        out = self.run([ids])[0]
        self.advance([ids])
        return out

    def prefill(self, ids: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """``step`` over ``ids`` in chunks of ``chunk`` tokens (0: one step); the last chunk's logits."""
        if chunk < 0:
            raise UsageError(f"chunk must be >= 0 tokens, found {chunk}")
        size = chunk or max(int(ids.shape[-1]), 1)
        out = torch.empty(0)
        for start in range(0, int(ids.shape[-1]), size):
            out = self.step(ids[:, start : start + size])
        return out

    def generate(
        self, prompt: list[list[int]], max_new_tokens: int, chunk: int = 0
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy decoding: the prompt as one prefill step (or chunks of ``chunk`` tokens), then one token
        per step. The cache is sized for the whole sequence up front."""
        ids = torch.tensor(prompt, dtype=torch.int64)
        out: list[list[int]] = [[] for _ in prompt]
        steps: list[torch.Tensor] = []
        self.cache.reserve(self.past + ids.shape[-1] + max(max_new_tokens - 1, 0))
        for i in range(max_new_tokens):
            logits = (self.prefill(ids, chunk) if i == 0 else self.step(ids))[:, -1]
            steps.append(logits)
            nxt = logits.argmax(-1)
            for row, t in zip(out, nxt.tolist(), strict=True):
                row.append(int(t))
            ids = nxt[:, None]
        self.lm.memory["kv_cache"] = self.kv_bytes()
        self.lm.memory["runtime_workspace"] = self.workspace
        return out, steps
