"""A streamed single-file source quantized with ``--scheme`` (a float ``.gguf``) without the model ever
being held: the quantizing half of the streaming frontend for sources whose loader already streams
(``rebuilt.Filler`` with a ``FakeTensorMode``: every dense tensor a reference, the model fake).

Three steps, each a function, which ``api.requantize_streamed`` calls on the source's ``Capturable``:

1. ``planned``: plans which modules ``scheme`` quantizes on the fake model (``quantize_plan`` over the modules a
   forward uses: the choice ``qcompiler.quantize`` makes in memory);
2. ``quantized`` reads each planned weight from its reference (rows in transformers' order, the source's dtype
   kept), quantizes it (``stream.quantize_weight``: the compile's per-weight hook freezes and packs it
   while it is held), its codes and qparams into the blob store, in a pool of ``jobs`` workers with
   at most ``2 * jobs`` weights resident (``parallel.ordered_map``: the same bytes for any ``jobs``);
3. and swaps each quantized module in as a fake copy, drops the float weight's reference (the artifact
   holds the codes, never the float weight), and gives each module tied to a quantized weight the
   twin that reads its buffers when the scheme quantizes a tied weight once (llama.cpp's mixtures:
   ``registry.shares_tied``). Any other tie to a planned weight is ``NotStreamable``: the in-memory
   frontend keeps ``qcompiler.quantize``'s own answer for it.

Rung 3's float weights are ``Requant.floats`` (``RefWeights``), read from the same references when
asked. Between steps 1 and 2, ``stand_up`` may swap in the stand-ins of step 3's modules and give
placeholders for what step 2 stores: the model is then exported in a forked child while ``quantized``
runs (``api.capture_beside``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from qcompiler.frontend.hf import PREFIX, Capturable
from qcompiler.frontend.skeleton import fake_copy, mode_of
from qcompiler.frontend.stream import NotStreamable, WeightHook, quantize_weight
from qcompiler.ir.blobs import read_blob
from qcompiler.ir.core import BlobRef, TensorDecl
from qcompiler.ir.interpret import as_torch
from qcompiler.parallel import ordered_map
from qcompiler.quant.conv1d import is_conv1d


class RefWeights(Mapping[str, torch.Tensor]):
    """Weight name -> its float weight in the source's dtype, made from its blob reference when read
    (a ``Conv1D``'s, ``transposed``, as the ``[N, K]`` Linear weight it computes)."""

    def __init__(self, refs: dict[str, BlobRef], transposed: frozenset[str] = frozenset()) -> None:
        self.refs, self.transposed = refs, transposed

    def stored(self, name: str) -> torch.Tensor:
        """The weight as the source stores it (a ``Conv1D``'s ``[K, N]``)."""
        ref = self.refs[name]
        data = read_blob(TensorDecl(name, ref))
        arr = np.frombuffer(data, dtype=np.dtype(ref.dtype.numpy).newbyteorder("<")).reshape(ref.shape)
        return as_torch(arr, ref.dtype.name)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.stored(name)
        return t.t() if name in self.transposed else t

    def __contains__(self, name: object) -> bool:
        return name in self.refs

    def __iter__(self) -> Iterator[str]:
        return iter(self.refs)

    def __len__(self) -> int:
        return len(self.refs)


@dataclass
class Requant:
    """A streamed source's requantization, planned (step 1) and not yet run: see ``planned``."""

    cap: Capturable
    scales: str
    plan: dict[str, str]
    """fqn -> the scheme of each module quantized."""
    twins: dict[str, str]
    names: dict[str, str]
    """fqn -> its weight's name (``<module>.weight``)."""
    floats: RefWeights
    templates: dict[str, nn.Module]
    stand_ins: dict[str, nn.Module] = field(default_factory=dict[str, nn.Module])


def planned(cap: Capturable, scheme: str, embeddings: bool, scales: str) -> Requant:
    """Step 1 on ``cap`` (its model fake, ``cap.lazy`` every tensor's reference): nothing read, nothing
    changed; ``NotStreamable`` for what only the in-memory frontend does (a whole-model scheme, a tie
    the scheme does not share)."""
    from qcompiler.frontend.capture import hf_config
    from qcompiler.frontend.source_info import used_modules
    from qcompiler.frontend.stamp import used_by_layers
    from qcompiler.quant.modules import quantize_plan
    from qcompiler.quant.registry import shares_tied, whole_model

    model, lazy, mode = cap.module, cap.lazy, mode_of(cap.module)
    if lazy is None or mode is None:
        raise NotStreamable("the source's loader holds the model's weights")
    if whole_model(scheme):
        raise NotStreamable(f"scheme {scheme} quantizes the whole model at once")
    with mode:
        used = used_by_layers(model, hf_config(model), lambda: used_modules(model, cap.inputs))
    plan = quantize_plan(model, scheme, embeddings=embeddings, only=used)
    twins = tied_to(model, plan, shares_tied(scheme))
    names = {fqn: fqn.removeprefix(PREFIX) + ".weight" for fqn in plan}
    transposed = frozenset(names[f] for f in plan if is_conv1d(model.get_submodule(f)))
    floats = RefWeights({w: lazy[w] for w in names.values()}, transposed)
    templates = {fqn: model.get_submodule(fqn) for fqn in plan}
    return Requant(cap, scales, dict(plan), twins, names, floats, templates)


def stand_up(r: Requant) -> dict[str, BlobRef] | None:
    """Swap into the model, for each planned module, the stand-in its quantized module will be
    (``stand_ins.stand_in``: fake buffers of the real shapes and dtypes), its twins too, and drop the
    float weights' references: the model as ``quantized`` will leave it, for an export beside the
    quantization (``api.capture_beside``). Returns a placeholder for each tensor ``quantized`` will
    store (``<weight>.<buffer>``), or ``None``, the model unchanged, when a stand-in cannot be told."""
    from qcompiler.frontend.forked import placeholders
    from qcompiler.frontend.stand_ins import stand_in
    from qcompiler.ir.interpret import TORCH

    mode = mode_of(r.cap.module)
    assert mode is not None
    kinds: dict[tuple[Any, ...], nn.Module | None] = {}
    stands: dict[str, nn.Module] = {}
    for fqn, scheme in r.plan.items():
        dtype = TORCH.get(r.floats.refs[r.names[fqn]].dtype.name)
        stand = None if dtype is None else stand_in(r.templates[fqn], scheme, dtype, r.scales, mode, kinds)
        if stand is None:
            return None
        stands[fqn] = stand
    r.stand_ins = stands
    swapped(r, stands)
    return placeholders({}, r.stand_ins)


def quantized(
    r: Requant,
    jobs: int,
    progress: Callable[[int], Callable[[int], None]] | None,
    ahead: WeightHook | None,
) -> bool:
    """Steps 2-3: each planned weight read, quantized and stored, its module's fake copy swapped in.
    After ``stand_up``: whether every real module is the one its stand-in showed the export
    (``stand_ins.same_module``); without, True."""
    from qcompiler.frontend.stand_ins import same_module

    floats, names, lazy, mode = r.floats, r.names, r.cap.lazy, mode_of(r.cap.module)
    assert lazy is not None
    assert mode is not None
    total = sum(floats.refs[w].nbytes for w in names.values())
    advance = progress(total) if progress is not None else None

    def job(fqn: str) -> dict[str, Any]:
        name = names[fqn]
        done = quantize_weight(name, floats.stored(name), r.plan[fqn], r.templates[fqn], r.scales, ahead)
        if advance is not None:
            advance(floats.refs[name].nbytes)
        return done

    held, made = True, {}
    for fqn, done in zip(r.plan, ordered_map(job, list(r.plan), jobs), strict=True):
        lazy.update(done["refs"])
        made[fqn] = fake_copy(done["module"], mode)
        stand = r.stand_ins.get(fqn)
        held = held and (stand is None or same_module(stand, done["module"]))
    swapped(r, made)
    return held


def swapped(r: Requant, modules: Mapping[str, nn.Module]) -> None:
    """``modules`` swapped in for the planned ones, the twins made of them, the float references dropped."""
    from qcompiler.quant.modules import swap_module, tied_twin

    model, lazy = r.cap.module, r.cap.lazy
    assert lazy is not None
    for fqn, mod in modules.items():
        swap_module(model, fqn, mod)
    for fqn, first in r.twins.items():
        swap_module(model, fqn, tied_twin(model.get_submodule(first), model.get_submodule(fqn)))
    for name in [*r.names.values(), *(f.removeprefix(PREFIX) + ".weight" for f in r.twins)]:
        lazy.pop(name, None)  # the codes stand for it now


def tied_to(model: nn.Module, plan: Mapping[str, str], shared: bool) -> dict[str, str]:
    """Each module whose weight a planned module quantizes too -> that module, when the scheme
    ``shared`` a tied weight; else ``NotStreamable`` for any such tie."""
    first: dict[int, str] = {}
    twins: dict[str, str] = {}
    for fqn, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.Tensor):
            continue
        seen = first.setdefault(id(w), fqn)
        if seen == fqn:
            continue
        planned = seen in plan or fqn in plan
        if planned and (not shared or fqn in plan or seen not in plan):
            raise NotStreamable(f"quantized weight {seen}.weight is tied to {fqn}")
        if planned:
            twins[fqn] = seen
    return twins
