"""The GGUF reader's tables: the keys llama.cpp requires of each architecture (with their exact types)
and the tensors its graph reads (name -> required), globally and per layer. An MoE architecture's layer
reads its experts (``archs_moe.moe_layer_tensors``) in place of the dense FFN when ``{arch}.expert_count``
> 0; qwen2moe and qwen3moe require it (their loaders refuse ``n_expert == 0``).
"""

from __future__ import annotations

from qcompiler.backends.gguf.archs_moe import moe_layer_tensors
from qcompiler.backends.gguf.rope_freqs import TENSOR as ROPE_FREQS
from qcompiler.backends.gguf.writer import GGUFValueType as V

MOE_ARCHS = ("qwen2moe", "qwen3moe")


def decoder_keys(arch: str) -> dict[str, V]:
    """The keys llama.cpp requires of every llama-like decoder, with their exact types."""
    ints = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count")
    return {**{f"{arch}.{k}": V.UINT32 for k in ints}, f"{arch}.attention.layer_norm_rms_epsilon": V.FLOAT32}


REQUIRED_KEYS: dict[str, dict[str, V]] = {
    **{a: decoder_keys(a) for a in ("llama", "qwen2", "qwen3", "gemma", "phi3")},
    "gemma2": {
        **decoder_keys("gemma2"),
        "gemma2.attention.sliding_window": V.UINT32,
        "gemma2.attn_logit_softcapping": V.FLOAT32,
        "gemma2.final_logit_softcapping": V.FLOAT32,
    },
    "gemma3": {**decoder_keys("gemma3"), "gemma3.attention.sliding_window": V.UINT32},
    **{a: {**decoder_keys(a), f"{a}.expert_count": V.UINT32, f"{a}.expert_used_count": V.UINT32} for a in MOE_ARCHS},
    "gpt2": {
        "gpt2.context_length": V.UINT32,
        "gpt2.embedding_length": V.UINT32,
        "gpt2.block_count": V.UINT32,
        "gpt2.feed_forward_length": V.UINT32,
        "gpt2.attention.head_count": V.UINT32,
        "gpt2.attention.layer_norm_epsilon": V.FLOAT32,
    },
    "bert": {
        "bert.context_length": V.UINT32,
        "bert.embedding_length": V.UINT32,
        "bert.block_count": V.UINT32,
        "bert.feed_forward_length": V.UINT32,
        "bert.attention.head_count": V.UINT32,
        "bert.attention.layer_norm_epsilon": V.FLOAT32,
        "tokenizer.ggml.token_type_count": V.UINT32,
    },
}
LAYER_TENSORS = {
    "llama": [
        ("attn_norm.weight", True),
        ("attn_q.weight", True),
        ("attn_k.weight", True),
        ("attn_v.weight", True),
        ("attn_output.weight", True),
        ("attn_q.bias", False),
        ("attn_k.bias", False),
        ("attn_v.bias", False),
        ("attn_output.bias", False),
        ("ffn_norm.weight", True),
        ("ffn_gate.weight", True),
        ("ffn_up.weight", True),
        ("ffn_down.weight", True),
    ],
    "qwen2": [
        ("attn_norm.weight", True),
        *((f"attn_{t}.{s}", True) for t in ("q", "k", "v") for s in ("weight", "bias")),
        ("attn_output.weight", True),
        *((f"ffn_{t}.weight", True) for t in ("norm", "gate", "up", "down")),
    ],
    "qwen3": [
        ("attn_norm.weight", True),
        *((f"attn_{t}.weight", True) for t in ("q", "k", "v", "output", "q_norm", "k_norm")),
        *((f"ffn_{t}.weight", True) for t in ("norm", "gate", "up", "down")),
    ],
    "gemma": [
        *((f"attn_{t}.weight", True) for t in ("norm", "q", "k", "v", "output")),
        *((f"ffn_{t}.weight", True) for t in ("norm", "gate", "up", "down")),
    ],
    "gemma2": [
        *((f"attn_{t}.weight", True) for t in ("norm", "q", "k", "v", "output")),
        *((f"{t}.weight", True) for t in ("post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")),
        ("post_ffw_norm.weight", True),
    ],
    "gemma3": [
        *((f"attn_{t}.weight", True) for t in ("norm", "q", "k", "v", "output", "q_norm", "k_norm")),
        *((f"{t}.weight", True) for t in ("post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")),
        ("post_ffw_norm.weight", True),
    ],
    "phi3": [
        *((f"attn_{t}.weight", True) for t in ("norm", "qkv", "output")),
        *((f"ffn_{t}.weight", True) for t in ("norm", "up", "down")),
    ],
    "bert": [
        (f"{t}.{s}", True)
        for t in (
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "attn_output_norm",
            "ffn_up",
            "ffn_down",
            "layer_output_norm",
        )
        for s in ("weight", "bias")
    ],
}
LAYER_TENSORS["gpt2"] = [
    (f"{t}.{s}", True)
    for t in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
    for s in ("weight", "bias")
]
LAYER_TENSORS["qwen3moe"] = LAYER_TENSORS["qwen3"]
LAYER_TENSORS["qwen2moe"] = [(t, required and not t.endswith(".bias")) for t, required in LAYER_TENSORS["qwen2"]]
"""qwen2moe: qwen2's layer, its q/k/v biases optional (llama.cpp loads them when present)."""
DECODER_GLOBALS = [("token_embd.weight", True), ("output_norm.weight", True), ("output.weight", False)]
GLOBAL_TENSORS = {
    "llama": [*DECODER_GLOBALS, (ROPE_FREQS, False)],
    "qwen2": DECODER_GLOBALS,
    "qwen3": DECODER_GLOBALS,
    "phi3": DECODER_GLOBALS,
    "qwen3moe": DECODER_GLOBALS,
    "qwen2moe": [*DECODER_GLOBALS[:2], ("output.weight", True)],
    "gemma": DECODER_GLOBALS[:2],
    "gemma2": DECODER_GLOBALS[:2],
    "gemma3": DECODER_GLOBALS[:2],
    "gpt2": [
        ("token_embd.weight", True),
        ("position_embd.weight", True),
        ("output_norm.weight", True),
        ("output_norm.bias", True),
        ("output.weight", False),
    ],
    "bert": [
        ("token_embd.weight", True),
        ("position_embd.weight", True),
        ("token_types.weight", False),
        ("token_embd_norm.weight", True),
        ("token_embd_norm.bias", True),
    ],
}


def expected_tensors(arch: str, n_layers: int, moe: bool = False) -> dict[str, bool]:
    """Every tensor llama.cpp's graph for ``arch`` reads -> whether it is required; ``moe``: with
    ``{arch}.expert_count`` > 0, the experts' FFN (``archs_moe.moe_layer_tensors``)."""
    out = dict(GLOBAL_TENSORS[arch])
    layer = moe_layer_tensors(LAYER_TENSORS[arch], arch) if moe else LAYER_TENSORS[arch]
    for i in range(n_layers):
        out.update({f"blk.{i}.{name}": required for name, required in layer})
    return out
