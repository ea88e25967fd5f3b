"""Built-in example: a tiny Llama-shaped decoder (GQA, rotary, SwiGLU MLP, RMS norm), in QIR.

The weights are deterministic pseudo-random codes and scales (seeded), quantized W4 with groups of
32 along K for the attention and MLP projections and W8 per-channel for the embedding; ``lm_head``
stays dense, as exporters usually leave it. ``qcompiler demo`` prints it. Once the frontend lands, the
demo builds the same shape from a real PyTorch model instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from qcompiler.ir.builder import Builder

if TYPE_CHECKING:
    from torch import nn
from qcompiler.ir.core import Module, Value
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.types import DenseType, Dim


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    layers: int = 1
    group: int = 32
    eps: float = 1e-06


F32 = DTYPES["f32"]


def f32(*shape: Dim) -> DenseType:
    return DenseType(F32, tuple(shape))


class _Maker:
    def __init__(self, cfg: TinyLlamaConfig, seed: int) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        self.b = Builder(
            Module("tiny_llama", attrs={"invariants": [], "provenance": {"source": "qcompiler.examples", "seed": seed}})
        )

    def w4(self, name: str, n: int, k: int) -> Value:
        codes = self.rng.integers(-8, 8, size=(n, k), dtype=np.int8)
        scale = (self.rng.random((n, -(-k // self.cfg.group))) * 0.02 + 0.005).astype(np.float16)
        return self.b.affine_weight(name, codes, scale, bits=4, group=self.cfg.group)

    def proj(self, x: Value, name: str, n: int, k: int, shape: tuple[Dim, ...]) -> Value:
        w = self.w4(name, n, k)
        return self.b.op("q.linear", [x, w], f32(*shape, n), out=name.rsplit(".", 1)[-1].replace("_proj", ""))

    def norm(self, x: Value, name: str) -> Value:
        g = self.b.const(f"{name}.weight", np.ones(self.cfg.hidden, dtype=np.float32))
        return self.b.op("rms_norm", [x, g], x.type, {"eps": self.cfg.eps}, out=name.rsplit(".", 1)[-1])

    def heads(self, x: Value, n_heads: int, tag: str) -> Value:
        hd = self.cfg.hidden // self.cfg.heads
        r = self.b.op("reshape", [x], f32(1, "?seq", n_heads, hd), {"shape": [1, "?seq", n_heads, hd]}, out=f"{tag}_r")
        return self.b.op("transpose", [r], f32(1, n_heads, "?seq", hd), {"perm": [0, 2, 1, 3]}, out=f"{tag}_t")

    def layer(self, h: Value, i: int, cos: Value, sin: Value) -> Value:
        c, b, p = self.cfg, self.b, f"layers.{i}"
        hd = c.hidden // c.heads
        seq = (1, "?seq")
        x = self.norm(h, f"{p}.input_layernorm")
        q = self.heads(self.proj(x, f"{p}.self_attn.q_proj", c.hidden, c.hidden, seq), c.heads, "q")
        k = self.heads(self.proj(x, f"{p}.self_attn.k_proj", c.kv_heads * hd, c.hidden, seq), c.kv_heads, "k")
        v = self.heads(self.proj(x, f"{p}.self_attn.v_proj", c.kv_heads * hd, c.hidden, seq), c.kv_heads, "v")
        q = b.op("rotary", [q, cos, sin], q.type, {"style": "half"}, out="q_rot")
        k = b.op("rotary", [k, cos, sin], k.type, {"style": "half"}, out="k_rot")
        attn = b.op("sdpa", [q, k, v], f32(1, c.heads, "?seq", hd), {"causal": True, "scale": hd**-0.5}, out="attn")
        attn = b.op("transpose", [attn], f32(1, "?seq", c.heads, hd), {"perm": [0, 2, 1, 3]}, out="attn_t")
        attn = b.op("reshape", [attn], f32(*seq, c.hidden), {"shape": [1, "?seq", c.hidden]}, out="attn_flat")
        h = b.op("add", [h, self.proj(attn, f"{p}.self_attn.o_proj", c.hidden, c.hidden, seq)], h.type, out="h_attn")
        x = self.norm(h, f"{p}.post_attention_layernorm")
        gate = b.op(
            "silu",
            [self.proj(x, f"{p}.mlp.gate_proj", c.intermediate, c.hidden, seq)],
            f32(*seq, c.intermediate),
            out="act",
        )
        up = self.proj(x, f"{p}.mlp.up_proj", c.intermediate, c.hidden, seq)
        mlp = b.op("mul", [gate, up], up.type, out="gated")
        return b.op(
            "add", [h, self.proj(mlp, f"{p}.mlp.down_proj", c.hidden, c.intermediate, seq)], h.type, out="h_out"
        )

    def build(self) -> Module:
        c, b = self.cfg, self.b
        hd = c.hidden // c.heads
        g = b.graph(
            "forward",
            input_ids=DenseType(DTYPES["i64"], (1, "?seq")),
            cos=f32(1, 1, "?seq", hd),
            sin=f32(1, 1, "?seq", hd),
        )
        ids, cos, sin = g.args
        codes = self.rng.integers(-127, 128, size=(c.vocab, c.hidden), dtype=np.int8)
        scale = (self.rng.random((c.vocab, 1)) * 0.01 + 0.001).astype(np.float16)
        emb = b.affine_weight("embed_tokens", codes, scale, bits=8, group=c.hidden, req="embedding")
        h = b.op("q.embedding", [emb, ids], f32(1, "?seq", c.hidden), out="h")
        for i in range(c.layers):
            h = self.layer(h, i, cos, sin)
        h = self.norm(h, "norm")
        head = b.const("lm_head.weight", (self.rng.standard_normal((c.vocab, c.hidden)) * 0.02).astype(np.float32))
        logits = b.op("linear", [h, head], f32(1, "?seq", c.vocab), out="logits")
        b.ret(logits)
        return b.module


def tiny_llama(cfg: TinyLlamaConfig | None = None, seed: int = 0) -> Module:
    """The built-in example module (weights held in this process's blob store)."""
    return _Maker(cfg or TinyLlamaConfig(), seed).build()


def _llama(seed: int, hidden: int, ffn: int, tied: bool) -> nn.Module:
    """A seeded float ``LlamaForCausalLM``: vocab 128, 2 layers, 4 heads over 2 KV heads, context 64."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_llama_hf(seed: int = 0) -> nn.Module:
    """A tiny transformers ``LlamaForCausalLM`` (float, seeded): a ``pkg.module:factory`` SOURCE,
    ``qcompiler compile qcompiler.examples:tiny_llama_hf --scheme w4-g32``."""
    return _llama(seed, 64, 128, tied=False)


def tiny_llama_wide_hf(seed: int = 0) -> nn.Module:
    """A tiny Llama wide enough for 128-wide groups (hidden 256), with tied input/output embeddings."""
    return _llama(seed, 256, 512, tied=True)


def tiny_llama_wide_untied_hf(seed: int = 0) -> nn.Module:
    """``tiny_llama_wide_hf`` with separate input and output embeddings (hidden 256: whole K-quant
    super-blocks, so llama.cpp's mixtures apply without fallbacks)."""
    return _llama(seed, 256, 512, tied=False)


def tiny_bert_hf(seed: int = 0) -> nn.Module:
    """A tiny transformers ``BertModel`` (hidden 256, so 128-wide groups fit; float, seeded)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=128,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
    )
    return transformers.BertModel(cfg).eval()


def tiny_llama_f16_hf(seed: int = 0) -> nn.Module:
    """``tiny_llama_hf`` in float16: fp16 activations end to end (the Triton kernels' usual case)."""
    import torch

    return tiny_llama_hf(seed).to(torch.float16)


def tiny_llama_bf16_hf(seed: int = 0) -> nn.Module:
    """``tiny_llama_hf`` in bfloat16 (compressed-tensors keeps scales in the model dtype: ``--scheme``
    stores bf16 scales for it, and a model quantized with float32 scales is a conversion)."""
    import torch

    return tiny_llama_hf(seed).to(torch.bfloat16)
