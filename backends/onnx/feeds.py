"""Inputs for an artifact's ``model.onnx`` in onnxruntime, and greedy decoding with its KV cache.

```python
sess = ort.InferenceSession("out/model.onnx", sess_options=session_options(1))
logits = run(sess, prefill_feed(sess, ids))["logits"]  # ids: int64 [batch, seq]; mask and cache filled in
```

``prefill_feed`` fills every input the session declares: ``attention_mask`` (ones unless given: 0
marks left padding), ``position_ids`` from the mask as optimum and onnxruntime-genai make them
(``cumsum(mask) - 1``, padding at 1) and an empty cache (``past_sequence_length`` 0) of the dtype
and head shape each ``past_key_values.*`` input declares. An encoder's ``model.onnx`` (BERT) gets
``input_ids`` and ``attention_mask``; a no-cache graph only what it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PAST, PRESENT = "past_key_values.", "present."
ORT_TYPES: dict[str, type[np.generic]] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
}
"""onnxruntime's input type strings -> the numpy dtype of an empty cache."""


def positions(mask: np.ndarray, new: int) -> np.ndarray:
    """int64 ``[batch, new]``: the positions of the last ``new`` tokens of ``mask`` (padding at 1)."""
    pos = np.cumsum(mask, axis=-1) - 1
    pos = np.where(mask == 0, 1, pos)
    return pos[:, mask.shape[1] - new :].astype(np.int64)


def prefill_feed(session: Any, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> dict[str, Any]:
    """Every input of ``session`` for a first run over ``input_ids`` ``[batch, seq]`` (module docstring)."""
    ids = np.asarray(input_ids, dtype=np.int64)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask is {list(mask.shape)}, input_ids {list(ids.shape)}: they must agree")
    feed: dict[str, Any] = {"input_ids": ids}
    for i in session.get_inputs():
        if i.name == "attention_mask":
            feed[i.name] = mask
        elif i.name == "position_ids":
            feed[i.name] = positions(mask, ids.shape[1])
        elif i.name.startswith(PAST):
            if i.type not in ORT_TYPES:
                raise ValueError(f"{i.name}: a cache of {i.type} (known: {', '.join(ORT_TYPES)})")
            feed[i.name] = np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), ORT_TYPES[i.type])
    return feed


def run(session: Any, feed: dict[str, Any]) -> dict[str, np.ndarray]:
    """``session``'s outputs by name."""
    names = [o.name for o in session.get_outputs()]
    return {n: np.asarray(v) for n, v in zip(names, session.run(None, feed), strict=True)}


def step_feed(out: dict[str, np.ndarray], feed: dict[str, Any], tokens: np.ndarray) -> dict[str, Any]:
    """The inputs of the next run after ``feed`` gave ``out``: ``tokens`` ``[batch, n]`` after the cache
    ``out`` returned, the mask ``n`` columns longer."""
    n = tokens.shape[1]
    mask = np.concatenate([feed["attention_mask"], np.ones((tokens.shape[0], n), np.int64)], axis=1)
    nxt: dict[str, Any] = {"input_ids": np.asarray(tokens, dtype=np.int64), "attention_mask": mask}
    nxt["position_ids"] = positions(mask, n)
    nxt.update({PAST + k.removeprefix(PRESENT): v for k, v in out.items() if k.startswith(PRESENT)})
    return nxt


@dataclass
class Decoded:
    """Greedy decoding's result: the chosen tokens ``[batch, steps]`` and, for each step, the last
    position's logits ``[batch, vocab]`` that chose them (step 0: the prefill's)."""

    tokens: np.ndarray
    logits: list[np.ndarray] = field(default_factory=list[np.ndarray])


def greedy(session: Any, input_ids: np.ndarray, steps: int, attention_mask: np.ndarray | None = None) -> Decoded:
    """``steps`` greedy tokens after ``input_ids``: the prefill, then one token a run through the cache."""
    feed = prefill_feed(session, input_ids, attention_mask)
    chosen: list[np.ndarray] = []
    logits: list[np.ndarray] = []
    for step in range(steps):
        out = run(session, feed)
        last = out["logits"][:, -1]
        logits.append(last)
        chosen.append(last.argmax(-1)[:, None])
        if step + 1 < steps:
            feed = step_feed(out, feed, chosen[-1])
    empty = np.zeros((np.asarray(input_ids).shape[0], 0), np.int64)
    return Decoded(np.concatenate(chosen, axis=1) if chosen else empty, logits)


def teacher_forced(session: Any, input_ids: np.ndarray, prefill: int) -> np.ndarray:
    """The logits ``[batch, seq, vocab]`` of ``input_ids`` run through the cache: the first ``prefill``
    tokens on an empty cache, then the rest one token a run."""
    ids = np.asarray(input_ids, dtype=np.int64)
    feed = prefill_feed(session, ids[:, :prefill])
    rows: list[np.ndarray] = []
    for t in range(prefill, ids.shape[1] + 1):
        out = run(session, feed)
        rows.append(out["logits"])
        if t < ids.shape[1]:
            feed = step_feed(out, feed, ids[:, t : t + 1])
    return np.concatenate(rows, axis=1)
