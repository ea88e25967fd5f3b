"""The model facts the runtime files restate, read from ``graph.qir`` and from a transformers config.

``graph_facts`` reads them from the graph: the number of ``sdpa`` ops (layers), the query heads
(``q [B, H, S, D]``), the key/value heads behind the grouped-query repeat (``ir.kv.repeat_source``),
the head size, the hidden size (the ``embedding`` of the graph's ids) and, for a causal LM, the
vocabulary (the logits' last dim). ``config_facts`` reads the same facts from config.json through
``CONFIG_KEYS`` (GPT-2 spells them ``n_layer``, ``n_head``, ``n_embd``).

    %embedding = embedding(%w, %input_ids) : tensor<f32[?batch,?seq,64]>        # hidden 64
    %sdpa = sdpa(%q, %k, %v) {causal = true} : tensor<f32[?batch,4,?seq,16]>     # 4 heads of 16
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qcompiler.ir.core import Module, Value
from qcompiler.ir.kv import causal_lm_dims, producers, repeat_source
from qcompiler.ir.ops.attention import Sdpa
from qcompiler.ir.ops.dense import Embedding
from qcompiler.ir.types import DenseType

CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "hidden": ("hidden_size", "n_embd"),
    "vocab": ("vocab_size",),
    "context": ("max_position_embeddings", "n_positions"),
}
"""A fact -> the config.json keys that may hold it, first found wins. ``kv_heads`` defaults to the
heads, ``head_dim`` to hidden / heads (as transformers' attention modules compute them)."""


@dataclass(frozen=True)
class GraphFacts:
    layers: int
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    hidden: int | None
    vocab: int | None
    causal: bool

    def get(self, fact: str) -> int | None:
        value = getattr(self, fact, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def dim(v: Value, axis: int) -> int | None:
    t = v.type
    if not isinstance(t, DenseType) or not -t.rank <= axis < t.rank:
        return None
    d = t.shape[axis]
    return d if isinstance(d, int) else None


def graph_facts(m: Module) -> GraphFacts | None:
    """The facts of ``m``'s first graph (module docstring); None for a graph without attention."""
    g = m.graphs[0]
    attention = [op for op in g.ops if isinstance(op, Sdpa)]
    if not attention:
        return None
    first = attention[0]
    kv, _ = repeat_source(producers(g), first.k)
    args = {id(a) for a in g.args}
    embeds = [op for op in g.ops if isinstance(op, Embedding) and id(op.ids) in args]
    causal = causal_lm_dims(g) is not None
    out = g.ops[-1].operands[0] if g.ops and g.ops[-1].operands else None
    return GraphFacts(
        layers=len(attention),
        heads=dim(first.q, 1),
        kv_heads=dim(kv, 1),
        head_dim=dim(kv, 3),
        hidden=dim(embeds[0].result, -1) if embeds else None,
        vocab=dim(out, -1) if causal and out is not None else None,
        causal=causal,
    )


def config_facts(config: dict[str, Any]) -> dict[str, int]:
    """The facts config.json states (``CONFIG_KEYS``), defaults applied; only integer values."""
    out: dict[str, int] = {}
    for fact, keys in CONFIG_KEYS.items():
        value = next((config[k] for k in keys if config.get(k) is not None), None)
        if isinstance(value, int) and not isinstance(value, bool):
            out[fact] = value
    if "heads" in out:
        out.setdefault("kv_heads", out["heads"])
        if "hidden" in out and out["heads"] > 0:
            out.setdefault("head_dim", out["hidden"] // out["heads"])
    return out


def config_key(config: dict[str, Any], fact: str) -> str:
    """The config.json key that states ``fact`` (the first of ``CONFIG_KEYS``' when none does)."""
    keys = CONFIG_KEYS[fact]
    return next((k for k in keys if config.get(k) is not None), keys[0])


def disagreements(config: dict[str, Any], facts: GraphFacts) -> list[tuple[str, int, int | None]]:
    """``(config key, graph.qir's value, config's value)`` for each fact both state and that differ."""
    stated = config_facts(config)
    out: list[tuple[str, int, int | None]] = []
    for fact in CONFIG_KEYS:
        want = facts.get(fact)
        if want is not None and stated.get(fact) != want:
            out.append((config_key(config, fact), want, stated.get(fact)))
    return out
