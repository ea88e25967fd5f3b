"""llama.cpp's quantization schemes, given to the built-in quantizer (``SCHEMES`` in this package's
declarations; ``qcompiler/quant/registry.py``):

| scheme | kind | a weight becomes |
|---|---|---|
| ``q8_0 q4_0 q5_0`` | affine | ``QuantLinear`` codes, f16 scales: llama.cpp's reference rounding |
| ``q4_k q5_k q6_k q4_1 q5_1 tq1_0 tq2_0`` | module | ``GgmlLinear`` blocks (``quant_blocks.py``) |
| ``q4_k_m q5_k_m`` | module | the ggml type llama.cpp's mixture gives it (``mixtures.py``) |
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch
from torch import nn

from qcompiler.backends.gguf.codecs import get_codec
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.backends.gguf.mixtures import MIXTURES, expert_count, layer_of, mixture_type
from qcompiler.backends.gguf.quant_blocks import K_SCHEMES, ggml_embedding, ggml_linear
from qcompiler.quant.conv1d import as_linear, is_linear, linear_shape, source_of
from qcompiler.quant.modules import QuantEmbedding, QuantLinear, swap_module, tied_twin
from qcompiler.quant.rtn import AffineQuant, QuantizeError, quantize_weight
from qcompiler.quant.schemes import Scheme

AFFINE = {"q8_0": 8, "q4_0": 4, "q5_0": 5}
"""llama.cpp's symmetric 32-element block types, quantized with its reference rounding (f16 scales)."""


class GgmlSchemes:
    """The provider (``qcompiler.quant.registry.SchemeProvider``) of every scheme above."""

    described = "a ggml block type quantized as llama.cpp does"

    def scheme(self, name: str) -> Scheme | None:
        return Scheme(AFFINE[name], 32, True, False, name) if name in AFFINE else None

    def round(self, w: torch.Tensor, scheme: Scheme) -> AffineQuant:
        """llama.cpp's reference quantizer for a symmetric 32-element block type: the same codes and
        float16 scales its C code writes, as an ``AffineQuant`` (codes signed, scale f16)."""
        k = int(w.shape[1])
        if k % 32:
            raise QuantizeError(f"{scheme.name}: K = {k} is not a multiple of the 32-element block")
        codec = get_codec(GGMLType[str(scheme.rounding).upper()])
        parts = codec.split(codec.quantize(w.detach().to(torch.float32).numpy()))
        return AffineQuant(
            codes=torch.from_numpy(np.ascontiguousarray(parts["codes"], dtype=np.int8)),
            scale=torch.from_numpy(np.ascontiguousarray(parts["scale"], dtype=np.float16)),
            zero=None,
            qmin=scheme.qmin,
            qmax=scheme.qmax,
            group=32,
        )

    def plan(
        self, model: nn.Module, name: str, exclude: tuple[str, ...], embeddings: bool, only: Collection[str] | None
    ) -> dict[str, str]:
        """K-quants: every Linear not excluded (embeddings are never K-quantized); a mixture: each
        module's ggml type, a weight tied to several modules planned once (``mixture_plan``)."""
        if name in MIXTURES:
            return mixture_plan(model, name, only)[0]
        plan: dict[str, str] = {}
        for fqn, mod in model.named_modules():
            if not is_linear(mod) or any(fqn == e or fqn.endswith("." + e) for e in exclude):
                continue
            if only is None or fqn in only:
                plan[fqn] = name
        return plan

    def quantize(
        self, model: nn.Module, name: str, exclude: tuple[str, ...], embeddings: bool, only: Collection[str] | None
    ) -> nn.Module:
        if name in MIXTURES:
            return quantize_mixture(model, name, only)
        for fqn, mod in list(model.named_modules()):
            if not is_linear(mod) or any(fqn == e or fqn.endswith("." + e) for e in exclude):
                continue
            if only is not None and fqn not in only:
                continue
            swap_module(model, fqn, ggml_linear(as_linear(mod), name))  # type: ignore[arg-type]
        return model

    def module(self, mod: nn.Module, name: str) -> nn.Module:
        return ggml_module(mod, name)

    def ties(self, name: str) -> bool:
        """Whether a weight tied to several modules is quantized once, at the first module ``plan``
        names, the others reading its blocks (``tied_twin``): llama.cpp's mixtures."""
        return name in MIXTURES


GGML = GgmlSchemes()


def quantize_mixture(model: nn.Module, scheme: str, only: Collection[str] | None) -> nn.Module:
    """llama.cpp's ``q4_k_m``/``q5_k_m``: each Linear and Embedding (``lm_head`` included) gets the ggml
    type ``llama_model_quantize`` would give it (see ``mixtures``), quantized byte-exactly. A head
    tied to the embedding table shares the table's blocks, quantized once with the output's type."""
    plan, twins = mixture_plan(model, scheme, only)
    for fqn, ggml in plan.items():
        swap_module(model, fqn, ggml_module(model.get_submodule(fqn), ggml))
    for fqn, first in twins.items():
        swap_module(model, fqn, tied_twin(model.get_submodule(first), model.get_submodule(fqn)))
    return model


def mixture_plan(model: nn.Module, scheme: str, only: Collection[str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """``quantize_mixture``'s choices, from names, kinds and shapes alone: module -> its ggml type, and
    each module whose weight a planned module holds already (tied) -> that module."""
    mods = [(fqn, mod) for fqn, mod in model.named_modules() if is_linear(mod) or isinstance(mod, nn.Embedding)]
    layers = 1 + max((layer_of(fqn) for fqn, _ in mods), default=-1)
    experts = expert_count(fqn for fqn, _ in mods)
    owners: dict[int, int] = {}
    for _, mod in mods:
        owners[id(mod.weight)] = owners.get(id(mod.weight), 0) + 1
    plan: dict[str, str] = {}
    twins: dict[str, str] = {}
    done: dict[int, str] = {}
    for fqn, mod in mods:
        first = done.get(id(mod.weight))
        if first is not None:
            twins[fqn] = first
            continue
        if only is not None and fqn not in only and not isinstance(mod, nn.Embedding):
            continue
        k = linear_shape(mod)[1]
        embedding = isinstance(mod, nn.Embedding)
        tied = owners[id(mod.weight)] > 1
        ggml = mixture_type(scheme, fqn.removeprefix("hf."), k, layers, tied, embedding, experts)
        if ggml is not None:
            plan[fqn] = ggml.lower()
            done[id(mod.weight)] = fqn
    return plan, twins


def ggml_module(mod: nn.Module, ggml: str) -> nn.Module:
    """``mod`` quantized to the ggml type ``ggml`` (K-quants as blocks, Q8_0/Q5_0 as affine codes); a
    ``Conv1D`` as the Linear it computes."""
    name = ggml.lower()
    source = source_of(mod, name)
    mod = as_linear(mod)
    if name in K_SCHEMES:
        return ggml_linear(mod, name) if isinstance(mod, nn.Linear) else ggml_embedding(mod, name)  # type: ignore[arg-type]
    s = GGML.scheme(name)
    if s is None:
        raise QuantizeError(f"{ggml}: not supported yet as a mixture fallback (rows of K = {mod.weight.shape[1]})")  # type: ignore[union-attr]
    w = mod.weight.detach()  # type: ignore[union-attr]
    q = quantize_weight(w.float(), s)
    if isinstance(mod, nn.Linear):
        return QuantLinear(q, mod.bias, w.dtype, source)
    assert isinstance(mod, nn.Embedding)
    return QuantEmbedding(q, mod.padding_idx, w.dtype, source)
