"""llama.cpp's mixture presets (``--scheme q4_k_m``, ``q5_k_m``): which ggml type each tensor gets, the
same per-tensor choices ``llama_model_quantize`` makes (``llama_tensor_get_type``) for dense llama
and BERT models without an importance matrix.

| tensor (GGUF category) | ``q4_k_m`` | ``q5_k_m`` |
|---|---|---|
| ``output.weight`` (or ``token_embd`` when tied to it) | Q6_K | Q6_K |
| ``attn_v`` (or a fused ``attn_qkv``), ``ffn_down`` in "more bits" layers | Q6_K | Q6_K |
| every other 2-D weight (``token_embd``, ``attn_q/k/output``, ``ffn_gate/up``, ...) | Q4_K | Q5_K |
| 1-D tensors, norms, any embedding but the token table (``position_embd``, ``token_types``) | unchanged | unchanged |

A model of exactly 8 experts per layer (Mixtral-8x7B's shape) follows llama.cpp's special case:
``attn_v`` and ``attn_k`` are Q8_0, and ``attn_output`` is Q5_K in ``q4_k_m``.

"More bits" layers: ``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2`` (integer division). A row whose
length is not a whole 256-element super-block falls back as llama.cpp does: Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0 (and ``output`` goes straight to Q8_0).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MIXTURES = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K"}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
CATEGORIES: tuple[tuple[str, str], ...] = (
    (r"(.*\.)?lm_head", "output"),
    (r"(.*\.)?(embed_tokens|word_embeddings|wte)", "token_embd"),
    (r".*\.(v_proj|qkv_proj|attention\.self\.value|attn\.c_attn)", "attn_v"),
    (r".*\.(mlp\.down_proj|layer\.\d+\.output\.dense|mlp\.c_proj|layers\.\d+\.fc2)", "ffn_down"),
    (r".*\.experts\.\d+\.(w2|down_proj)", "ffn_down"),
    (r".*\.shared_expert\.down_proj", "ffn_down"),
    (r".*\.self_attn\.k_proj", "attn_k"),
    (r".*\.self_attn\.o_proj", "attn_output"),
)
"""HF module name -> llama.cpp's tensor category (anything else takes the base type). An embedding
other than the token table (learned positions, token types) is never quantized: llama.cpp keeps
``position_embd`` and ``token_types`` as they are (and a module replacing OPT's positions would not
take its ``position_ids``). An expert's down projection is ``ffn_down_exps``, which llama.cpp counts as
``ffn_down`` (one stacked tensor per layer), and so is a shared expert's (``ffn_down_shexp``: Q6_K in
the same "more bits" layers, measured on qwen2moe); a MoE router is no Linear here and stays float, as
llama.cpp keeps ``ffn_gate_inp`` (and Qwen2-MoE's shared-expert gate, ``ffn_gate_inp_shexp``).
llama.cpp counts a fused ``attn_qkv`` as ``attn_v`` (measured: its
``llama_model_quantize`` gives GPT-2's and Phi-3's ``attn_qkv`` the ``attn_v`` types)."""


EIGHT_EXPERTS = {
    ("q4_k_m", "attn_v"): "Q8_0",
    ("q5_k_m", "attn_v"): "Q8_0",
    ("q4_k_m", "attn_k"): "Q8_0",
    ("q5_k_m", "attn_k"): "Q8_0",
    ("q4_k_m", "attn_output"): "Q5_K",
}
"""(scheme, category) -> the type llama.cpp gives it in a model of exactly 8 experts, over the rules above."""


def expert_count(modules: Iterable[str]) -> int:
    """The number of experts per MoE layer (``...experts.N...`` modules), 0 for a dense model."""
    found = (re.search(r"\.experts\.(\d+)\.", m) for m in modules)
    return 1 + max((int(f.group(1)) for f in found if f), default=-1)


def category(module: str) -> str:
    return next((cat for pattern, cat in CATEGORIES if re.fullmatch(pattern, module)), "other")


def layer_of(module: str) -> int:
    m = re.search(r"\.(?:layers|layer|h)\.(\d+)\.", module)
    return int(m.group(1)) if m else -1


def more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mixture_type(
    scheme: str, module: str, k: int, n_layers: int, tied: bool, embedding: bool = False, experts: int = 0
) -> str | None:
    """The ggml type llama.cpp's ``scheme`` mixture gives ``module``'s weight (``k`` columns), or
    ``None`` when it stays as it is (``embedding``: the module is an embedding table; ``experts``: the
    model's experts per MoE layer, ``expert_count``)."""
    base = MIXTURES[scheme]
    cat = category(module)
    if embedding and cat != "token_embd":
        return None
    if cat == "token_embd" and tied:
        cat = "output"
    if cat == "output":
        return "Q6_K" if k % 256 == 0 else "Q8_0"
    wanted = "Q6_K" if cat in ("attn_v", "ffn_down") and more_bits(layer_of(module), n_layers) else base
    if experts == 8:
        wanted = EIGHT_EXPERTS.get((scheme, cat), wanted)
    if wanted not in FALLBACK:  # Q8_0: 32-element blocks
        return wanted if k % 32 == 0 else None
    if k % 256 == 0:
        return wanted
    fallback = FALLBACK[wanted]
    return fallback if k % 32 == 0 else None
