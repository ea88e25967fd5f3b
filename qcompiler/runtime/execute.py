"""Run a loaded model from its QIR graph with the kernels the loader selected.

Dense ops use the reference interpreter's rules (``qcompiler.ir.interpret.RULES``); every quantized op
runs on its selected kernel (``prefill`` decisions for a step of more than one token, ``decode`` for one).
A causal LM keeps a KV cache (``Session``): for each causal ``sdpa`` the keys and values before the
grouped-query repeat (``qcompiler.ir.kv.repeat_source``) are appended to the cache, repeated over the
query heads, and attended with a causal mask offset by the cache length; the rotary positions
continue from the cache length. ``Session.generate`` decodes greedily.

    lm = qcompiler.load("out/tiny-w4")
    s = Session(lm)
    tokens = s.generate([[1, 2, 3]], max_new_tokens=16)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from qcompiler.ir.core import Op
from qcompiler.ir.interpret import RULES, Env, InterpretError, attend, bind_dims, check_ids
from qcompiler.ir.kv import causal_lm_dims, is_position, producers, repeat_source
from qcompiler.ir.ops.attention import Sdpa, keep_mask
from qcompiler.ir.ops.quant import QEmbedding, weight_name
from qcompiler.runtime.load import LoadedModel, kernel

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Session:
    """One stream of execution over a loaded model, with its KV cache (causal LMs)."""

    lm: LoadedModel
    cache: dict[int, KV] = field(default_factory=dict[int, KV])
    """Layer (causal sdpa index) -> (keys, values) ``[batch, kv_heads, past, head_dim]``."""
    kernels_used: dict[str, set[str]] = field(default_factory=dict[str, set[str]])
    """Phase -> the kernels that ran in it."""
    pending: dict[int, KV] = field(default_factory=dict[int, KV])
    workspace: int = 0
    """The most bytes of intermediate values one step held (this executor keeps a step's values to its end)."""
    """This step's keys and values, moved into ``cache`` when the step ends."""

    @property
    def past(self) -> int:
        return int(self.cache[0][0].shape[2]) if self.cache else 0

    def kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.cache.values())

    def run_named(self, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step, keeping every value by result name (``return``: the first output)."""
        named: dict[str, torch.Tensor] = {}
        self.pending = {}
        named["return"] = self.run(inputs, named)[0]
        self.cache.update(self.pending)
        return named

    def run(self, inputs: list[torch.Tensor], named: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """One step: the graph on ``inputs``; a causal LM appends to its cache (see ``step``)."""
        g = self.lm.graph
        dims = causal_lm_dims(g)
        env = Env(self.lm.module)
        dev = self.lm.place.torch_device
        inputs = [x.to(dev) for x in inputs]
        bind_dims(env, g.args, inputs)
        phase = "decode" if dims is not None and inputs[0].shape[-1] == 1 and self.cache else "prefill"
        made_by = producers(g)
        values: dict[int, Any] = {id(a): x for a, x in zip(g.args, inputs, strict=True)}
        layer = 0
        with torch.no_grad(), torch.device(dev):  # factory ops in the rules make tensors on the device
            for op in g.ops:
                xs = [values[id(v)] for v in op.operands]
                if op.name == "return":
                    held = sum(v.numel() * v.element_size() for v in values.values() if isinstance(v, torch.Tensor))
                    self.workspace = max(self.workspace, held)
                    return xs
                if dims is not None and is_position(op, dims[1]):
                    values[id(op.result)] = torch.arange(
                        self.past, self.past + env.size(dims[1]), dtype=torch.int64, device=dev
                    )
                elif dims is not None and isinstance(op, Sdpa) and op.causal and len(xs) == 3:
                    values[id(op.result)] = self.attend(op, xs[0], made_by, values, layer)
                    layer += 1
                elif op.name.startswith("q."):
                    values[id(op.result)] = self.quantized(op, xs, phase)
                elif op.name == "const":
                    values[id(op.result)] = self.lm.constant(env, op)
                else:
                    fn = RULES.get(op.name)
                    if fn is None:
                        raise InterpretError(f"{op.describe()}: no rule for '{op.name}'")
                    values[id(op.result)] = fn(env, op, xs)
                if named is not None and op.results and isinstance(values[id(op.result)], torch.Tensor):
                    named[op.result.name] = values[id(op.result)]
        raise InterpretError("graph has no return")

    def attend(self, op: Sdpa, q: torch.Tensor, made_by: dict[int, Op], values: dict[int, Any], layer: int) -> Any:
        (k_src, rep), (v_src, _) = repeat_source(made_by, op.k), repeat_source(made_by, op.v)
        k_new, v_new = values[id(k_src)], values[id(v_src)]
        if layer in self.cache:
            k_new = torch.cat([self.cache[layer][0], k_new], dim=2)
            v_new = torch.cat([self.cache[layer][1], v_new], dim=2)
        self.pending[layer] = (k_new, v_new)
        k, v = k_new.repeat_interleave(rep, dim=1), v_new.repeat_interleave(rep, dim=1)
        mask = keep_mask(q.shape[-2], k.shape[-2], op.window, q.device)  # queries after the cached keys
        if op.softcap is not None:
            return attend(op, q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=op.scale)

    def quantized(self, op: Op, xs: list[Any], phase: str) -> Any:
        if op.name == "q.weight":
            return op  # the kernel reads its own prepared weight
        w: Op = xs[1] if op.name == "q.linear" else xs[0]
        name = weight_name(w)
        d = self.lm.decision(name, phase)
        k = kernel(d.selected)
        assert k.run is not None
        self.kernels_used.setdefault(phase, set()).add(k.id)
        handle = self.lm.handles[(name, d.selected)]
        if op.name == "q.linear":
            return k.run(handle, xs[0], xs[2] if len(xs) > 2 else None)
        if isinstance(op, QEmbedding):
            return k.run(handle, check_ids(xs[1], int(op.w.type.shape[0]), op), None)
        return handle["weight"]  # q.dequantize: the fallback's dense buffer

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits for ``ids`` ``[batch, new]`` after the cached tokens; the cache then holds them too."""
        self.pending = {}
        out = self.run([ids])[0]
        self.cache.update(self.pending)
        return out

    def generate(self, prompt: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy decoding: the prompt as one prefill step, then one token per step."""
        ids = torch.tensor(prompt, dtype=torch.int64)
        out: list[list[int]] = [[] for _ in prompt]
        steps: list[torch.Tensor] = []
        for _ in range(max_new_tokens):
            logits = self.step(ids)[:, -1]
            steps.append(logits)
            nxt = logits.argmax(-1)
            for row, t in zip(out, nxt.tolist(), strict=True):
                row.append(int(t))
            ids = nxt[:, None]
        self.lm.memory["kv_cache"] = self.kv_bytes()
        self.lm.memory["runtime_workspace"] = self.workspace
        return out, steps
