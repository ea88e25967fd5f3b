"""onnxruntime-genai on our ONNX artifacts: the same tokens as ``qcompiler run``, and a padded batch
decoded row by row as each prompt alone.

The artifacts are ``tests/test_onnx_package.py``'s: tiny random causal LMs with a byte-level BPE
tokenizer, compiled to onnx-nbits (w4-g32). genai makes the attention mask and position ids of a
batch from its pad token (``genai_config.json``'s ``pad_token_id``), scanning each row from the
end: trailing pad tokens are masked (0) and generation continues after them, while leading ones are
taken as tokens. So genai pads on the right, and our decoder graph honours whatever mask it is
given in prefill and decode (``kv_cache.py``): each row of a right-padded batch must get exactly the
tokens it gets alone. (Left padding, what transformers and optimum use, is tested through
onnxruntime in ``test_onnx_decoder.py`` and through optimum in ``test_onnx_optimum.py``.) ``-s``
prints the tokens.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx_peers import source
from prequant_packers import compile_to

from qcompiler.testing import run_cli

pytestmark = pytest.mark.peer

STEPS = 10
SHORT, LONG = [17, 3, 90], [5, 9, 33, 7, 100, 4, 61]


def genai(art: Path, prompts: list[list[int]]) -> list[list[int]]:
    """genai's greedy tokens after each prompt, the batch right-padded with the pad id (genai's way)."""
    og: Any = importlib.import_module("onnxruntime_genai")  # ships no type stubs
    model = og.Model(str(art))
    pad = json.loads((art / "genai_config.json").read_text())["model"]["pad_token_id"]
    assert all(pad not in p for p in prompts)  # a prompt token equal to the pad id would be masked
    width = max(len(p) for p in prompts)
    batch = np.array([p + [pad] * (width - len(p)) for p in prompts], np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + STEPS, min_length=width + STEPS, batch_size=len(prompts))
    gen = og.Generator(model, params)
    gen.append_tokens(batch)
    mask = np.array([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    assert np.array_equal(np.asarray(gen.get_input("attention_mask")), mask)  # what genai made of the pads
    while not gen.is_done():
        gen.generate_next_token()
    return [[int(t) for t in gen.get_sequence(i)[width:]] for i in range(len(prompts))]


def qcompiler_run(art: Path, prompt: list[int]) -> list[int]:
    r = run_cli("run", str(art), "--tokens", ",".join(map(str, prompt)), "--max-new-tokens", str(STEPS), "--json")
    assert r.code == 0, r.err
    return [int(t) for t in json.loads(r.out)["generated"]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_genai_equals_qcompiler_run_and_decodes_a_padded_batch_row_by_row(family: str, tmp_path: Path) -> None:
    src = source(tmp_path / "src", family)
    art = tmp_path / "art"
    assert compile_to(src, "onnx-nbits", art, "--scheme", "w4-g32").code == 0
    short, long = genai(art, [SHORT]), genai(art, [LONG])
    batch = genai(art, [SHORT, LONG])
    print(f"{family}: alone {short} {long}, batch {batch}")
    assert len(short[0]) == STEPS
    assert short[0] == qcompiler_run(art, SHORT)
    assert long[0] == qcompiler_run(art, LONG)
    assert batch == [*short, *long]
