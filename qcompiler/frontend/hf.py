"""transformers models and compile SOURCEs: what to export, on which inputs, with which dynamic dims.

A SOURCE is an HF-style model directory (``config.json`` + ``*.safetensors``), a ``.gguf`` file (read
by ``backends/gguf/source.py``: codes kept as they are), or ``pkg.module:factory``.
A factory returns an HF ``PreTrainedModel`` (wrapped like a directory's model) or a ready
``Capturable``. Wrappers keep the HF parameter names (``model.layers.0.mlp.up_proj.weight``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qcompiler import plugins
from qcompiler.errors import UsageError
from qcompiler.ir.blobs import BlobRef

if TYPE_CHECKING:
    from qcompiler.frontend.rebuilt import Work

PREFIX = "hf."
"""Attribute under which wrappers hold the HF model; stripped from tensor names."""


class CausalLMLogits(nn.Module):
    """``input_ids -> logits`` without a KV cache (decoder-only LMs such as Llama)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, use_cache=False).logits


class EncoderHidden(nn.Module):
    """``(input_ids, attention_mask) -> last_hidden_state`` (BERT-style encoders)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


@dataclass
class Capturable:
    """A module ready for ``capture``: example inputs, dynamic dims, and a name."""

    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    dynamic: Mapping[str, Mapping[int, Any]] = field(default_factory=dict[str, Mapping[int, Any]])
    name: str = "model"
    provenance: dict[str, Any] = field(default_factory=dict[str, Any])
    source: Any = None
    """The ``SourceInfo`` when the loader built it (a GGUF file); else the frontend gathers it."""
    state: dict[str, torch.Tensor] | None = None
    """The checkpoint's tensors by name when the loader knows them (else taken from the model)."""
    effective: Mapping[str, torch.Tensor] | None = None
    """Weight name -> the source format's own decode, when the loader computed it (a pre-quantized
    directory): what ``freeze-semantics`` proves the descriptors reproduce."""
    lazy: dict[str, BlobRef] | None = None
    """Checkpoint tensor name -> where its bytes are in the source (dtype kept), under ``base_dir``."""
    base_dir: str | None = None
    buffers: dict[str, torch.Tensor] | None = None
    """Real values of the buffers no checkpoint holds, when the module's are fake (a streamed source)."""
    reading: Reading | None = None
    """A source whose quantized layers are read beside the export (``rebuilt.Work.beside``)."""


@dataclass(frozen=True)
class Reading:
    """What a source still has to read once its model stands ready for the export: a placeholder for
    each tensor the reading will store (``forked.placeholder``, by tensor-table name), and the
    reading itself, which stores them in the source's ``lazy`` and says whether every real module is
    the one its stand-in showed the export."""

    holes: dict[str, BlobRef]
    read: Callable[[], bool]


def wrap_hf(model: nn.Module, name: str | None = None) -> Capturable:
    """Pick the wrapper and example inputs for a transformers model from its config."""
    cfg: Any = getattr(model, "config", None)
    if cfg is None:
        raise UsageError(
            f"{type(model).__name__} has no transformers config; return a Capturable from the factory instead"
        )
    vocab, max_pos = getattr(cfg, "vocab_size", None), getattr(cfg, "max_position_embeddings", 512)
    if type(vocab) is not int or vocab <= 0 or type(max_pos) is not int or max_pos < 2:
        raise UsageError(
            f"{type(model).__name__}: only text models with a vocabulary are compiled from a transformers model "
            f"(config vocab_size {vocab!r}, max_position_embeddings {max_pos!r})"
        )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 8), generator=gen)
    prov = {"source_class": type(model).__name__, "transformers": _version("transformers")}
    label = name or str(getattr(cfg, "model_type", "model"))
    if getattr(cfg, "is_decoder", False) or hasattr(model, "lm_head"):
        dyn = {"input_ids": {0: ("batch", 1, 64), 1: ("seq", 2, max_pos)}}
        return Capturable(CausalLMLogits(model).eval(), (ids,), dyn, label, prov)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    dyn = {
        "input_ids": {0: ("batch", 1, 64), 1: ("seq", 2, max_pos)},
        "attention_mask": {0: ("batch", 1, 64), 1: ("seq", 2, max_pos)},
    }
    return Capturable(EncoderHidden(model).eval(), (ids, mask), dyn, label, prov)


def _version(pkg: str) -> str:
    try:
        return importlib.import_module(pkg).__version__
    except ImportError:
        return "not installed"


def load_source(spec: str, streamed: bool = True, work: Work | None = None) -> Capturable:
    """Resolve a compile SOURCE into a ``Capturable``; ``streamed``: a single-file source may hand
    over a model that holds no weight (its tensors in the blob store); ``False`` for a compile that
    requantizes the source's float weights (``--scheme``). ``work``: threads and the per-layer
    hook a pre-quantized directory is read with (``frontend/rebuilt.py``)."""
    path = Path(spec)
    method = prequantized(path)
    if method is not None:
        return plugins.provide(prequant_loader(path, method))(spec, work=work)
    if path.is_dir():
        return load_hf_dir(path)
    loader = plugins.declared("SOURCE_FILES").get(path.suffix)  # single-file formats, by their backend
    if loader is not None and path.is_file():
        load = plugins.provide(loader)
        return load(spec, work=work) if streamed else load(spec, streamed=False, work=work)
    if ":" in spec and not path.exists():
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise UsageError(f"cannot load factory {spec!r}: {e}") from None
        made = call_factory(spec, factory)
        if isinstance(made, Capturable):
            return made
        if isinstance(made, nn.Module):
            return wrap_hf(made.eval(), attr)
        raise UsageError(f"factory {spec!r} returned {type(made).__name__}; expected an nn.Module or a Capturable")
    raise UsageError(
        f"SOURCE {spec!r} is neither a model directory (config.json + safetensors), a .gguf file, "
        "nor pkg.module:factory"
    )


def prequantized(path: Path) -> str | None:
    """The ``quant_method`` of a pre-quantized HF directory, ``None`` for anything else."""
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    from qcompiler.frontend.hf_dir import quant_method

    return quant_method(path)


def prequant_loader(path: Path, method: str) -> str:
    """The loader a backend declared for ``method``, or a ``SourceError`` naming the methods read."""
    from qcompiler.frontend.hf_dir import config_error

    loaders = plugins.declared("PREQUANTIZED")
    if method not in loaders:
        raise config_error(
            path,
            "this quantization method is not read as a source",
            "quantization_config.quant_method",
            " or ".join(sorted(loaders)),
            method,
        )
    return loaders[method]


def load_hf_dir(path: Path) -> Capturable:
    """An HF-style directory, read as untrusted input with the no-random-weights gate (``hf_dir``)."""
    from qcompiler.frontend.hf_dir import load_hf_dir as load_checked

    cap = wrap_hf(load_checked(path), path.name)
    cap.provenance["source_dir"] = path.name
    return cap


def call_factory(spec: str, factory: Any) -> object:
    """``factory()``; an exception it raises is the user's code failing, reported as a ``UsageError``
    naming the factory (``QC_DEBUG=1`` shows its traceback)."""
    from qcompiler.env import QC_DEBUG

    try:
        return factory()
    except Exception as e:
        if QC_DEBUG.level() >= 1:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise UsageError(
            f"factory {spec!r} raised {type(e).__name__}: {first} (rerun with QC_DEBUG=1 for its traceback)"
        ) from None
