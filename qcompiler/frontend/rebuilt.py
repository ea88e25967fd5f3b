"""A transformers model rebuilt from a config and filled, tensor by tensor, from a single-file source
(a ``.gguf``: ``backends/gguf/source.py``): the capture half such sources share. The source's own
module reads its file and knows its names and types; this module builds the model and puts the
tensors in, so a parameter is never initialised randomly.

- ``model_from_config(config, causal, **kwargs)``: the transformers model of ``config`` (a
  ``config.json``-style dict), every parameter on the meta device (no weight memory), buffers real;
- ``Filler``: puts the source's tensors into it. Each parameter, with its tied aliases, is filled
  once: a dense tensor becomes the parameter, a quantized one the module the source builds
  (``Filler.quantized``), swapped in, its tied aliases made its twins (``tied_twin``). A parameter
  still on the meta device at the end is an error naming it;
- ``Filler`` given the ``FakeTensorMode`` of a model built by ``skeleton.fake_model`` streams instead
  (nothing of the model is held): a dense parameter stays fake and the source says where its bytes
  are (``Filler.reference``: a location in the source file, read when written); a quantized module
  is built for one weight at a time, its buffers hashed into the blob store (the large ones as a
  recipe that builds the module again when read, ``blobs.derived``, so they are never held or
  spilled), and swapped in as a fake copy. ``Filler.lazy`` maps every tensor-table name to its
  reference, which ``capture`` binds. With ``Work.jobs`` > 1 the quantized modules are built in
  that many threads (``parallel.ordered_map``), swapped in in order by the calling thread;
  ``Filler.hook`` (made from ``Work.ahead``) freezes and packs each where it is stored. With
  ``Work.beside`` ``run`` only stands the model up (each quantized module built, its fake copy
  swapped in, nothing stored) and ``Filler.pending`` reads the layers later, beside the export
  (``api.capture_beside``), storing under the names ``Filler.placeholders`` gave;
- ``imported_state(model, quantized)``: the checkpoint's dense tensors by name, the quantized
  modules' own buffers left out (their ops cover them).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from qcompiler.frontend.context import to_numpy
from qcompiler.frontend.hf import PREFIX
from qcompiler.frontend.skeleton import fake_copy, parameters_on_meta
from qcompiler.frontend.source_info import checkpoint_state
from qcompiler.ir.blobs import derived, hashed, keep_bytes
from qcompiler.ir.core import BlobRef
from qcompiler.ir.dtypes import DTYPES
from qcompiler.parallel import ordered_map
from qcompiler.quant.modules import swap_module, tied_twin

if TYPE_CHECKING:
    from qcompiler.frontend.stream import WeightHook

PrequantHook = Callable[[str, nn.Module, Mapping[str, BlobRef], Mapping[str, np.ndarray], BlobRef, np.ndarray], None]
"""``(weight, module, buffer refs, buffer arrays, effective ref, effective values)``: the compile's
per-layer hook for a pre-quantized source (``passes/ahead.py``, ``Ahead.prequantized``)."""


@dataclass(frozen=True)
class Work:
    """How a source fills a streamed model: ``jobs`` threads build its quantized modules (any count
    gives the same model), and ``prequantized`` is called on each layer a pre-quantized source reads."""

    jobs: int = 1
    prequantized: PrequantHook | None = None
    beside: bool = False
    """Stand in first, read later: ``run`` builds each quantized module only to swap a fake copy of it
    in (nothing stored), and ``Filler.pending`` reads the layers, which the caller runs beside the
    export of the model (``api.capture_beside``)."""
    ahead: Callable[[Mapping[str, str]], WeightHook] | None = None
    """For a source whose layers decode as their modules' own dequantize (a ``.gguf``): the compile's
    per-weight hook (``passes/ahead.py``) for the source's provenance (``model_dtype``), which the
    source's loader makes once it has read its config (``Filler.hook``)."""


FILL_BYTES = 256 << 20
"""Source tensor bytes whose layers are read at once by a filler's threads (``Filler.each``)."""

DERIVED_BYTES = 1 << 20
"""A streamed quantized module's buffers of at least this size are kept as recipes, not bytes."""


def model_from_config(config: dict[str, Any], causal: bool, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM`` (``causal``) or ``AutoModel`` of ``config``, in eval mode, float32,
    parameters on the meta device; ``kwargs`` go to the model's constructor."""
    with parameters_on_meta():
        return float_model(config, causal, **kwargs)


def float_model(config: dict[str, Any], causal: bool, **kwargs: Any) -> nn.Module:
    """The same model with its parameters where the current mode puts them (under
    ``skeleton.fake_model``: fake)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model: nn.Module = auto.from_config(cfg, dtype=torch.float32, **kwargs)
    return model.eval()


class Filler(ABC):
    """Fills ``model``'s parameters from one source file (see the module docstring). A source says
    which of its tensors fills a parameter (``tensor_of``), its shape, whether it is dense, and builds
    the dense tensor or the quantized module; ``fail`` makes its typed error."""

    kind: ClassVar[str] = "source"
    """How messages name the source's tensors (``GGUF``)."""

    def __init__(self, model: nn.Module, mode: FakeTensorMode | None = None, work: Work | None = None) -> None:
        self.model, self.mode, self.work = model, mode, work or Work()
        self.deferred: list[tuple[list[str], str]] = []
        """With ``Work.beside``: the quantized parameters ``pending`` reads (names, source tensor)."""
        self.stands: dict[str, nn.Module] = {}
        """With ``Work.beside``: weight -> the fake module swapped in for it (its stand-in)."""
        self.originals: dict[str, nn.Module] = {}
        """With ``Work.beside``: weight -> the model's module that stand-in replaced."""
        self.lazy: dict[str, BlobRef] = {}
        """Tensor-table name -> where its bytes are (dense tensors; with ``mode``, every tensor)."""
        self.hook: WeightHook | None = None
        """Streamed: called on each quantized layer ``held_apart`` stores, while its buffers are in
        memory (``Work.ahead``'s hook: the layer frozen and packed there, proven against the module's
        own dequantize); ``None``: the passes read the layers again."""
        self.owners: dict[int, list[str]] = {}
        """``id`` of each parameter -> every name it has, the checkpoint's (first) one first."""
        for name, p in model.named_parameters(remove_duplicate=False):
            self.owners.setdefault(id(p), []).append(name)

    @abstractmethod
    def tensor_of(self, hf: str) -> str:
        """The source tensor that fills parameter ``hf`` (``check_inventory`` proved there is one)."""

    @abstractmethod
    def shape_of(self, src: str) -> tuple[int, ...]: ...

    @abstractmethod
    def is_dense(self, src: str) -> bool: ...

    @abstractmethod
    def dense(self, hf: str, src: str) -> torch.Tensor:
        """The float32 values of ``src``, laid out as parameter ``hf``."""

    @abstractmethod
    def quantized(self, hf: str, src: str, mod: nn.Module) -> nn.Module:
        """The quantized module replacing ``mod`` (a ``Linear`` or ``Embedding``), its codes ``src``'s."""

    def reference(self, hf: str, src: str) -> BlobRef:
        """Streamed (``mode``): where dense ``src``'s bytes are, for parameter ``hf``."""
        raise self.fail(src, "tensor", f"this {self.kind} source cannot be streamed", "in memory", "streamed")

    @abstractmethod
    def fail(self, where: str, field: str, message: str, expected: str = "", found: object = "") -> Exception: ...

    @abstractmethod
    def check_inventory(self) -> None:
        """Every parameter has a source tensor and every source tensor a parameter, else ``fail``."""

    def check_shape(self, hf: str, src: str, want: tuple[int, ...]) -> None:
        have = self.shape_of(src)
        if tuple(have) != tuple(want):
            raise self.fail(src, "shape", f"does not fit transformers {hf}", str(list(want)), list(have))

    def put_dense(self, names: list[str], src: str) -> None:
        hf = names[0]
        self.check_shape(hf, src, tuple(self.model.get_parameter(hf).shape))
        if self.mode is not None:  # the parameter stays fake; the source says where its bytes are
            ref = self.reference(hf, src)
            self.lazy.update(dict.fromkeys(names, ref))
            return
        # requires_grad like any checkpoint: --scheme finds the modules a forward uses by gradient
        p = nn.Parameter(self.dense(hf, src))
        for name in names:
            owner, _, attr = name.rpartition(".")
            setattr(self.model.get_submodule(owner) if owner else self.model, attr, p)

    def run(self) -> None:
        self.check_inventory()
        later: list[tuple[list[str], str]] = []
        for names in self.owners.values():
            src = self.tensor_of(names[0])
            if self.is_dense(src):
                self.put_dense(names, src)
            else:
                later.append((names, src))
        beside = self.mode is not None and self.work.beside
        built = self.standing(later) if beside else self.each(self.build, later)
        for (names, _src), made in zip(later, built, strict=True):
            hf = names[0]  # after the biases are real; the modules built in ``jobs`` threads, in order
            owner = hf.rpartition(".")[0]
            if self.mode is not None:
                made = fake_copy(made, self.mode)
            if beside:
                self.originals[hf], self.stands[hf] = self.model.get_submodule(owner), made
            swap_module(self.model, owner, made)
            for alias in names[1:]:
                alias_owner = alias.rpartition(".")[0]
                swap_module(self.model, alias_owner, tied_twin(made, self.model.get_submodule(alias_owner)))
        self.deferred = later if beside else []
        left = [n for n, p in self.model.named_parameters() if p.device.type == "meta"]
        if left:
            raise self.fail(left[0], "tensor", f"no {self.kind} tensor filled this parameter", "filled", "empty")

    def size_of(self, src: str) -> int:
        """Bytes source tensor ``src`` holds (``each``'s budget); 0: not counted."""
        return 0

    def each(
        self, fn: Callable[[tuple[list[str], str]], nn.Module], items: list[tuple[list[str], str]]
    ) -> Iterator[nn.Module]:
        """``fn`` of each layer in ``Work.jobs`` threads, in order, at most ``FILL_BYTES`` of source
        tensors in flight (``size_of``; a larger one, an 8B model's embedding, is read alone)."""
        return ordered_map(fn, items, self.work.jobs, lambda item: self.size_of(item[1]), FILL_BYTES)

    def kind_of(self, hf: str, src: str) -> Hashable | None:
        """A key two layers share when their quantized modules can differ only in values (class,
        shapes, dtypes, plain attributes): ``standing`` then reads one of them; ``None``: read each."""
        return None

    def standing(self, later: list[tuple[list[str], str]]) -> list[nn.Module]:
        """With ``Work.beside``: the module each quantized layer will be, nothing stored, one read
        (``translated``) per kind of layer (``kind_of``) and the others meta copies of it: only their
        class, shapes, dtypes and attributes reach the export, and ``pending`` holds every real module
        to its stand-in (``same_module``), so a wrong kind costs an export here, never the graph."""
        keys = [self.kind_of(names[0], src) for names, src in later]
        first: dict[Hashable, int] = {}
        for i, key in enumerate(keys):
            if key is not None:
                first.setdefault(key, i)
        read = [i for i, key in enumerate(keys) if key is None or first[key] == i]
        made = dict(zip(read, self.each(self.translated, [later[i] for i in read]), strict=True))
        metas = {key: copy.deepcopy(made[i]).to("meta") for key, i in first.items()}
        return [made[i] if i in made else copy.deepcopy(metas[key]) for i, key in enumerate(keys)]

    def pending(self) -> bool:
        """With ``Work.beside``, after ``run``: read every quantized layer (``build``, in ``jobs``
        threads), storing its buffers under the names ``placeholders`` gave; whether each real module
        is the one its stand-in showed the export (``stand_ins.same_module``: classes, tensor shapes
        and dtypes, plain attributes)."""
        from qcompiler.frontend.stand_ins import same_module

        held = True
        for (names, _src), made in zip(self.deferred, self.each(self.build, self.deferred), strict=True):
            held = same_module(self.stands[names[0]], made) and held
        return held

    def placeholders(self) -> dict[str, BlobRef]:
        """With ``Work.beside``, after ``run``: a placeholder (``forked.placeholders``) for each tensor
        ``pending`` will store, as its stand-in holds it: ``<weight>.<buffer>``."""
        from qcompiler.frontend.forked import placeholders

        return placeholders({}, {w.removesuffix(".weight"): m for w, m in self.stands.items()})

    def translated(self, item: tuple[list[str], str]) -> nn.Module:
        """The quantized module of one parameter (its names, its source tensor), nothing stored. Runs
        in a worker of ``run``: reads the model, sets nothing of it."""
        names, src = item
        hf = names[0]
        mod = self.original(hf)
        if hf.rpartition(".")[2] != "weight" or not isinstance(mod, nn.Linear | nn.Embedding):
            raise self.fail(src, "type", f"quantized, but transformers {hf} is not a Linear or Embedding weight")
        return self.quantized(hf, src, mod)

    def build(self, item: tuple[list[str], str]) -> nn.Module:
        """``translated``; streamed, its buffers stored too (``held_apart``)."""
        made = self.translated(item)
        if self.mode is not None:
            names, src = item
            hf = names[0]
            self.held_apart(hf, src, self.original(hf), made)
        return made

    def original(self, hf: str) -> nn.Module:
        """The model's module of weight ``hf`` before a quantized one was swapped in for it; streamed,
        as workers and recipes hand it to ``quantized``, its fake bias as a meta tensor (``meta_bias``)."""
        mod = self.originals[hf] if hf in self.originals else self.model.get_submodule(hf.rpartition(".")[0])
        return meta_bias(mod) if self.mode is not None else mod

    def held_apart(
        self, hf: str, src: str, mod: nn.Module, made: nn.Module
    ) -> tuple[dict[str, BlobRef], dict[str, np.ndarray]]:
        """Streamed: ``made``'s buffers into the blob store under ``<hf>.<buffer>`` (the names the
        lowering binds), the large ones as recipes that build the module again; their references and
        the arrays hashed, by buffer name."""
        refs: dict[str, BlobRef] = {}
        arrays: dict[str, np.ndarray] = {}
        for sub in made.modules():
            for bname, b in sub._buffers.items():
                if b is None:
                    continue
                arr, dtype = to_numpy(b)
                ref, pending = hashed(arr, DTYPES[dtype])
                if arr.nbytes >= DERIVED_BYTES:
                    derived(ref, self.remade(hf, src, mod, bname))
                elif pending is not None:
                    keep_bytes(ref.sha256, pending)
                self.lazy[f"{hf}.{bname}"] = refs[bname] = ref
                arrays[bname] = arr
        if self.hook is not None:  # its recipes are not needed: the large buffers are made from the file
            self.hook(hf, made, refs, arrays, None)
        return refs, arrays

    def remade(self, hf: str, src: str, mod: nn.Module, bname: str) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:  # in whichever thread reads the blob: ``mod`` is ``original``'s
            again = self.quantized(hf, src, mod)
            b = next(s._buffers[bname] for s in again.modules() if s._buffers.get(bname) is not None)
            assert b is not None
            return to_numpy(b)[0]

        return make


def meta_bias(mod: nn.Module) -> nn.Module:
    """``mod`` as a streamed fill hands it to ``Filler.quantized`` (``Filler.original``): a shallow copy
    whose bias (a fake tensor, like every parameter of the streamed model) is a meta tensor of its
    shape and dtype. A fake tensor is not safe to compute with in two threads at once (its mode's
    dispatch state is shared), and the quantized module copies its bias; ``run`` makes it fake again."""
    bias = getattr(mod, "bias", None)
    if not isinstance(bias, torch.Tensor):
        return mod
    twin = copy.copy(mod)
    twin._parameters = dict(mod._parameters)
    twin._parameters["bias"] = nn.Parameter(
        torch.empty(tuple(bias.shape), dtype=bias.dtype, device="meta"), requires_grad=False
    )
    return twin


def imported_state(model: nn.Module, quantized: tuple[type[nn.Module], ...]) -> dict[str, torch.Tensor]:
    """The checkpoint's dense tensors by name (persistent buffers included), the buffers of modules
    of the ``quantized`` types left out: their ops cover them."""
    return {k.removeprefix(PREFIX): v for k, v in checkpoint_state(model, quantized).items()}
