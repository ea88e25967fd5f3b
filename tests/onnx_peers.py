"""Shared by the ONNX runtime tests (``test_onnx_package``, ``test_onnx_genai_batch``, ``test_onnx_gqa``,
``test_onnx_decoder``): tiny random causal LMs saved by ``save_pretrained`` with a byte-level BPE
tokenizer; greedy tokens from onnxruntime-genai, onnxruntime (the decoder graph through its cache)
and transformers (the model holding an artifact's own decode); and the decoder graph's checks
against ``graph.qir`` and its padded batches, which both attention forms must pass."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from prequant_packers import artifact_decodes
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qcompiler.artifact.reader import open_artifact
from qcompiler.backends.onnx.dispatch import session_options
from qcompiler.backends.onnx.feeds import Decoded, greedy, prefill_feed, run
from qcompiler.backends.onnx.genai import DECODER_FILE
from qcompiler.ir.interpret import run_graph
from qcompiler.quant.experts import unfuse_experts

PROMPT = "the quick brown fox"
STEPS = 12
TEXT = ["the quick brown fox jumps over the lazy dog, hello world"] * 20
SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
KV = SIZES["num_key_value_heads"]
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {"tie_word_embeddings": False}),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, {"sliding_window": None}),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {"head_dim": 32}),
    "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig, {"head_dim": 16}),
    "gemma2": (
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config,
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6},
    ),
    "gemma3_text": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6},
    ),
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config, {"pad_token_id": 1}),
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig, {"num_local_experts": 4}),
    "qwen3_moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig,
        {"head_dim": 32, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2},
    ),
}
"""model_type -> (model class, config class, fixed config values)."""
FULL = ("llama", "qwen2")
"""The families the module's artifact fixture compiles (every check runs on llama)."""


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def source(root: Path, family: str, seed: int = 0, **over: Any) -> Path:
    """A ``save_pretrained`` directory of a tiny ``family`` model with its tokenizer."""
    model_cls, config_cls, fixed = FAMILIES[family]
    tok = tokenizer()
    torch.manual_seed(seed)
    model = model_cls(config_cls(vocab_size=len(tok), **{**SIZES, **fixed, **over})).eval()
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


def genai_tokens(art: Path) -> tuple[list[int], list[int]]:
    """The prompt as og.Tokenizer encodes it, and og.Generator's greedy tokens after it."""
    og: Any = importlib.import_module("onnxruntime_genai")  # ships no type stubs
    model = og.Model(str(art))
    ids = [int(t) for t in og.Tokenizer(model).encode(PROMPT)]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + STEPS)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    out: list[int] = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return ids, out


def onnxruntime_tokens(art: Path, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding through onnxruntime with the decoder graph (``feeds.greedy``: every input it
    declares, the cache from its own presents)."""
    import onnxruntime as ort

    from qcompiler.backends.onnx.dispatch import session_options

    sess = ort.InferenceSession(str(art / DECODER_FILE), sess_options=session_options(1))
    return [int(t) for t in greedy(sess, np.array([ids], np.int64), steps).tokens[0]]


def transformers_tokens(src: Path, art: Path, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy ``generate`` on the model whose Linear weights are the artifact's decode."""
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = unfuse_experts(model)  # a mixture's experts under the checkpoint's own names, as captured
    for name, values in artifact_decodes(art).items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]


def session(path: Path) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), sess_options=session_options(1), providers=["CPUExecutionProvider"])


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


GRAPH_PROMPT = np.array([[5, 17, 99, 3], [3, 99, 17, 5]], np.int64)


def decode_against_graph(art: Path, steps: int = 16) -> tuple[Decoded, list[float]]:
    """A prefill of ``GRAPH_PROMPT`` (4 tokens, batch 2), then ``steps`` greedy steps through
    ``art``'s decoder graph: each step's token must be the one the artifact's full-sequence QIR graph
    chooses. Returns the decoding and each step's logits rel-L2 from the graph's."""
    d = greedy(session(art / "model.onnx"), GRAPH_PROMPT, steps)
    tokens = np.concatenate([GRAPH_PROMPT, d.tokens], axis=1)
    ref = run_graph(open_artifact(art).module, [torch.tensor(tokens)])[0].double().numpy()
    errs = []
    for step, logits in enumerate(d.logits):
        want = ref[:, GRAPH_PROMPT.shape[1] - 1 + step]
        assert np.array_equal(logits.argmax(-1), want.argmax(-1)), step
        errs.append(rel_l2(logits, want))
    return d, errs


def assert_padded_batches_decode_as_alone(art: Path) -> None:
    """Prompts of 3 and 7 tokens, the short one left-padded, then two 5-token prompts: each row's 12
    greedy tokens equal its prompt's alone at batch 1, the last logits within 1e-5 rel-L2, and every
    logit of the padded prefill finite (a padding query sees no key)."""
    sess = session(art / "model.onnx")
    rng = np.random.default_rng(7)
    for lengths in ((3, 7), (5, 5)):
        prompts = [rng.integers(0, 100, n) for n in lengths]
        width = max(lengths)
        ids = np.zeros((2, width), np.int64)
        mask = np.zeros((2, width), np.int64)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
        assert np.isfinite(run(sess, prefill_feed(sess, ids, mask))["logits"]).all()
        batched = greedy(sess, ids, 12, mask)
        for row, p in enumerate(prompts):
            alone = greedy(sess, p[None], 12)
            assert np.array_equal(batched.tokens[row], alone.tokens[0]), (lengths, row)
            err = rel_l2(batched.logits[-1][row], alone.logits[-1][0])
            print(f"{art.parent.name} lengths {lengths} row {row}: 12 tokens equal, last logits {err:.2e} rel-L2")
            assert err <= 1e-5
