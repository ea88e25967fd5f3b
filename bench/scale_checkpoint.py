"""Seeded random bf16 Llama checkpoints of real shapes, written shard by shard (never the whole model
in memory): what ``bench/scale.py`` compiles and the memory tests build at small depth.

    python bench/scale_checkpoint.py OUT --shape 1.1b [--layers N] [--shard-mb 1000]

Shapes: ``small`` (hidden 1024, 8 layers, ff 2816, vocab 8192, GQA 16/4: the memory tests'), ``1.1b``
(hidden 2048, 22 layers, ff 5632, vocab 32000, GQA 32/4; TinyLlama's) and ``8b`` (hidden 4096, 32
layers, ff 14336, vocab 128256, GQA 32/8; Llama-3-8B's). Weights are normal(0, 0.02)
(norms 1.0), each tensor from its own seed, so a checkpoint is the same bytes on every machine.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "small": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "intermediate_size": 2816,
        "vocab_size": 8192,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
    },
    "1.1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 22,
        "intermediate_size": 5632,
        "vocab_size": 32000,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
    },
    "8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
    },
}


def tensor_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint tensor names and shapes, in the order transformers lists them (built on meta)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return [(n, tuple(p.shape)) for n, p in model.state_dict().items()]


def make_tensor(name: str, shape: tuple[int, ...]) -> Any:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)


def write_checkpoint(out: Path, shape: str = "1.1b", layers: int | None = None, shard_mb: int = 1000) -> Path:
    """Write config.json, the shards and (for more than one) the index into ``out``; returns ``out``."""
    import transformers
    from safetensors.torch import save_file

    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(
        **fields, tie_word_embeddings=False, dtype="bfloat16", architectures=["LlamaForCausalLM"]
    )
    out.mkdir(parents=True, exist_ok=True)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensor_shapes(config):
        nbytes = 2
        for d in dims:
            nbytes *= d
        if groups[-1] and size + nbytes > shard_mb * 10**6:
            groups.append([])
            size = 0
        groups[-1].append((name, dims))
        size += nbytes
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for file, group in zip(files, groups, strict=True):
        tensors = {name: make_tensor(name, dims) for name, dims in group}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.1b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--shard-mb", type=int, default=1000)
    args = ap.parse_args()
    write_checkpoint(args.out, args.shape, args.layers, args.shard_mb)


if __name__ == "__main__":
    main()
