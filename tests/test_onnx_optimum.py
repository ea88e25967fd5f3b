"""optimum's ``ORTModelForCausalLM`` runs our ONNX artifacts as they are.

optimum-onnx 0.1.0 pins transformers 4.57, so it runs in its own venv, which ``.ci/run`` creates and
names in ``QC_PEER_OPTIMUM`` (its python). Tiny random Llama, Qwen2 and Qwen3-MoE models are saved by
``save_pretrained`` and compiled to ``onnx-nbits`` (w4-g32); optimum loads each artifact directory
with its default file name (``from_pretrained(DIR)``, no ``file_name``, no export) and generates
greedily, at batch 1 and for a left-padded batch of two prompts. The tokens must equal transformers'
``generate`` on the same model holding the artifact's own decode of every quantized weight, for
the same inputs, and optimum must not take the artifact for a legacy export (no warning about
missing ``position_ids`` or a legacy file). ``-s`` prints the tokens.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import artifact_decodes

from qcompiler.quant.experts import unfuse_experts
from qcompiler.testing import run_cli

PYTHON = os.environ.get("QC_PEER_OPTIMUM", "")
pytestmark = [
    pytest.mark.peer,
    pytest.mark.skipif(
        not PYTHON,
        reason="optimum-onnx pins transformers 4.57: it runs in its own venv, which .ci/run creates "
        "(QC_PEER_OPTIMUM names its python)",
    ),
]

NEW_TOKENS = 10
PROMPTS: dict[str, list[list[int]]] = {
    "alone": [[5, 9, 33, 7, 100, 4, 61]],
    "short alone": [[17, 3, 90]],
    "left-padded": [[17, 3, 90], [5, 9, 33, 7, 100, 4, 61]],
}
"""Prompts by case; a batch is left-padded with the pad id and masked (what generators do)."""
PAD = 0

RUN = """
import json, sys
import torch
from optimum.onnxruntime import ORTModelForCausalLM

path, prompts, n, pad = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = ORTModelForCausalLM.from_pretrained(path)
out = {"tokens": {}}
for case, batch in prompts.items():
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=pad)
    out["tokens"][case] = got[:, width:].tolist()
print(json.dumps(out))
"""

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": PAD,
}

QWEN3_MOE: dict[str, Any] = {"head_dim": 16, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}

FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**COMMON, **QWEN3_MOE})),
}
"""Mixtral is not here: optimum-onnx 0.1.0 sizes the empty cache of a ``mixtral`` config with
``num_attention_heads`` (its list of grouped-query model types lacks it), so a grouped-query
Mixtral fails inside optimum before our graph runs (``past_key_values.1.key`` index 1: got 4,
expected 2). Qwen3-MoE is in that list; its head size here is hidden / heads (16), the only one
optimum 0.1.0 sizes a ``qwen3_moe`` cache with (it reads ``head_dim`` only for the Gemma types)."""


def holding_decode(model: Any, artifact: Path) -> Any:
    """``model`` (experts unfused, as the frontend captures them) with the artifact's own decode."""
    model = unfuse_experts(copy.deepcopy(model))
    decoded = artifact_decodes(artifact)
    assert decoded
    for name, values in decoded.items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    return model


def reference_tokens(model: Any) -> dict[str, list[list[int]]]:
    """transformers' greedy ``generate`` for every case of ``PROMPTS``."""
    out: dict[str, list[list[int]]] = {}
    for case, batch in PROMPTS.items():
        width = max(len(p) for p in batch)
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            got = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=PAD,
            )
        out[case] = got[:, width:].tolist()
    return out


def optimum_tokens(artifact: Path) -> tuple[dict[str, Any], str]:
    """optimum's tokens for every case, and what it printed on stderr."""
    cmd = [PYTHON, "-c", RUN, str(artifact), json.dumps(PROMPTS), str(NEW_TOKENS), str(PAD)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_optimum_generates_what_transformers_generates_on_the_decode(family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    src, out = tmp_path / "src", tmp_path / "onnx"
    model.save_pretrained(src)
    r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", "onnx-nbits", "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    got, stderr = optimum_tokens(out)
    want = reference_tokens(holding_decode(model, out))
    print(f"{family}: optimum {got['tokens']}, transformers {want}")
    assert got["tokens"] == want
    # each row of the padded batch is what its prompt gives alone
    assert got["tokens"]["left-padded"] == [*got["tokens"]["short alone"], *got["tokens"]["alone"]]
    assert "legacy" not in stderr, stderr[-2000:]
    assert "position_ids" not in stderr, stderr[-2000:]
