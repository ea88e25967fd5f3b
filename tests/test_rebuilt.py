"""``frontend/rebuilt.py``: a transformers model rebuilt from a config on the meta device and filled
tensor by tensor by a single-file source's importer; ties hold, and an unfilled parameter is an error
naming it, never a random weight."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from qcompiler.frontend.rebuilt import Filler, imported_state, model_from_config

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 40,
    "tie_word_embeddings": True,
}


class Filled(Exception):
    pass


class DictFiller(Filler):
    """Fills every parameter from a dict of float tensors named as transformers names them."""

    def __init__(self, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(model)
        self.tensors = tensors

    def check_inventory(self) -> None:
        return None

    def tensor_of(self, hf: str) -> str:
        return hf

    def shape_of(self, src: str) -> tuple[int, ...]:
        return tuple(self.tensors[src].shape) if src in self.tensors else ()

    def is_dense(self, src: str) -> bool:
        return src in self.tensors

    def dense(self, hf: str, src: str) -> torch.Tensor:
        return self.tensors[src]

    def quantized(self, hf: str, src: str, mod: nn.Module) -> nn.Module:
        raise self.fail(src, "tensor", "absent")

    def fail(self, where: str, field: str, message: str, expected: str = "", found: object = "") -> Exception:
        return Filled(f"{where}: {field}: {message}")


def shapes() -> dict[str, tuple[int, ...]]:
    model = model_from_config(CONFIG, causal=True)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_a_rebuilt_model_is_filled_with_its_ties_kept_and_no_weight_memory_before() -> None:
    model = model_from_config(CONFIG, causal=True)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.get_parameter("lm_head.weight") is model.get_parameter("model.embed_tokens.weight")
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen) for n, s in shapes().items()}
    DictFiller(model, tensors).run()
    assert model.get_parameter("lm_head.weight") is model.get_parameter("model.embed_tokens.weight")
    state = imported_state(model, ())
    assert set(state) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 40)
    assert bool(torch.isfinite(out).all())


def test_a_parameter_no_source_tensor_fills_is_an_error_naming_it() -> None:
    model = model_from_config(CONFIG, causal=True)
    tensors = {n: torch.zeros(s) for n, s in shapes().items() if n != "model.norm.weight"}
    with pytest.raises(Filled, match=r"model\.norm\.weight"):
        DictFiller(model, tensors).run()


def test_a_tensor_of_the_wrong_shape_is_refused_before_it_is_put_in() -> None:
    model = model_from_config(CONFIG, causal=True)
    tensors = {n: torch.zeros(s) for n, s in shapes().items()}
    tensors["model.norm.weight"] = torch.zeros(17)
    with pytest.raises(Filled, match=r"model\.norm\.weight: shape: does not fit"):
        DictFiller(model, tensors).run()
