"""The execution plan (``qcompiler/runtime/plan.py``) and its KV cache (``kvcache.py``): chunked prefill,
a cache that grows past its reservation, and one plan reused per phase and shape."""

from __future__ import annotations

import pytest
import torch

import qcompiler
from qcompiler.ir.interpret import InterpretError, run_graph
from qcompiler.runtime import LoadedModel, Session
from qcompiler.testing import run_cli

PROMPT = [[5, 17, 99, 3, 42, 7], [3, 99, 17, 5, 8, 1]]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    out = tmp_path_factory.mktemp("plan") / "w4"
    r = run_cli("compile", "qcompiler.examples:tiny_llama_hf", "--scheme", "w4-g32", "--target", "safetensors",
                "-o", str(out))  # fmt: skip
    assert r.code == 0, r.err
    return qcompiler.load(out, compute="f32")


def test_a_prompt_fed_in_chunks_decodes_like_one_prefill(lm: LoadedModel) -> None:
    whole_tokens, whole = Session(lm).generate(PROMPT, 6)
    chunked = Session(lm)
    tokens, steps = chunked.generate(PROMPT, 6, chunk=4)  # 4 tokens, then 2 after them (the offset mask)
    assert tokens == whole_tokens
    assert max(rel(a, b) for a, b in zip(steps, whole, strict=True)) <= 1e-5
    shapes = sorted(key[1][0][0] for key in chunked.plans)
    assert shapes == [(2, 1), (2, 2), (2, 4)]  # one plan per shape, the decode plan reused for 5 steps


def test_the_cache_grows_past_its_reservation_and_keeps_what_it_held(lm: LoadedModel) -> None:
    s = Session(lm)
    ids = torch.tensor(PROMPT)
    got = s.step(ids[:, :2])  # nothing reserved: the buffers hold exactly 2 positions
    for i in range(2, ids.shape[1]):
        got = s.step(ids[:, i : i + 1])  # each step past the capacity doubles it
    assert s.past == ids.shape[1]
    assert rel(got[:, -1], run_graph(lm.module, [ids])[0][:, -1]) <= 1e-5
    k, _ = s.cache.layers[0]
    assert k.shape[2] == 8  # 2 -> 4 -> 8
    assert s.kv_bytes() == 2 * len(s.cache.layers) * k.numel() * k.element_size()


def test_a_step_with_another_batch_is_refused_by_name(lm: LoadedModel) -> None:
    s = Session(lm)
    s.step(torch.tensor(PROMPT))
    with pytest.raises(InterpretError, match=r"KV cache layer 0: the cache holds batch x heads \[2, 2\]"):
        s.step(torch.tensor([[1]]))
