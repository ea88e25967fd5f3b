"""A model's repeated decoder layers lowered from an export of its first three ("stamping").

``torch.export`` of a decoder costs about a quarter of a second per layer here (half of it sympy's
symbolic shapes), the same work for every layer of a model whose layers are one module repeated:
5 CPU-s of a 1.1B Llama's 22 layers, against 2.2 s for its first three. So when a family's layers
are one repeated block (``LAYERS``), every layer from the second on is the same module as the
second (classes, tensor shapes and dtypes, every attribute but ``layer_idx``: ``repeats.py``) and no
per-layer list of the config tells them apart, the
model is exported with its layer list cut to three, lowered with each op tagged by the layer its FX
node ran in, and layers 3..L-1 are copies of layer 1 (``stamp``):

- layer 2, which the export traced, must be layer 1 *shifted* (tensor and value names with the
  layer's index moved by one, the same ops, types and attributes, each operand from the same place):
  this fixes, operand by operand, what a copy reads: a value of its own layer, the previous layer's
  (the hidden state, found where layer 2 reads layer 1), or one value every layer shares (rotary
  tables, the mask); anything else, and the model is exported whole instead;
- each copy's tensors are the source's own entries for that layer (``lazy``), of the template's
  dtypes and shapes, in the order the whole export would have added them (first use);
- the head reads the last copy wherever it read layer 2; names are numbered afresh (``names.py``).

The result is the module the whole export lowers to, text for text: the tests hold stamped and
whole captures of each family here to equality. Families left out, or a layer that differs (Gemma2's
alternating sliding windows, a mixture's dense first layers, GGUF K-quant mixtures whose layers mix
types), are exported whole, as is any model of fewer than ``MIN_LAYERS`` layers.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from qcompiler.frontend.hf import PREFIX
from qcompiler.frontend.names import Origin, renumber
from qcompiler.frontend.repeats import same_layer, uniform_config
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.core import Module, Op, TensorDecl, Value, create_op

STAMPED = 3
"""Layers exported: layer 0 (which may differ), layer 1 (the template) and layer 2 (its check)."""
MIN_LAYERS = 6
"""Fewer layers are exported whole (the saving would be a layer or two)."""

LAYERS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "llama": ("model.layers", lambda cfg: True),
    "mistral": ("model.layers", lambda cfg: True),
    "qwen2": ("model.layers", lambda cfg: True),
    "qwen3": ("model.layers", lambda cfg: True),
    "phi3": ("model.layers", lambda cfg: True),
    "gemma": ("model.layers", lambda cfg: True),
    "gemma2": ("model.layers", lambda cfg: True),
    "gemma3_text": ("model.layers", lambda cfg: True),
    "mixtral": ("model.layers", lambda cfg: True),
    "qwen2_moe": ("model.layers", lambda cfg: True),
    "qwen3_moe": ("model.layers", lambda cfg: True),
    "gpt2": ("transformer.h", lambda cfg: not getattr(cfg, "scale_attn_by_inverse_layer_idx", False)),
    "bert": ("encoder.layer", lambda cfg: True),
}
"""config ``model_type`` -> (the layer list's path in the transformers model, whether a config's
layers can be one block: GPT-2 can scale attention by ``1 / (layer_idx + 1)``). A family is here when
its forward treats every layer alike apart from what the layer modules hold (``same_layer``)."""


@dataclass(frozen=True)
class Layers:
    """The repeated layer list of a model about to be captured."""

    container: nn.ModuleList
    path: str
    """Its path in the transformers model (``model.layers``): tensor names start ``<path>.<i>.``."""

    @property
    def count(self) -> int:
        return len(self.container)

    def layer_of(self, node: fx.Node) -> int | None:
        """The layer an FX node ran in (its innermost ``<path>.<i>`` module), else ``None``."""
        pattern = re.compile(rf"^{re.escape(PREFIX + self.path)}\.(\d+)(?:\.|$)")
        for entry in (node.meta.get("nn_module_stack") or {}).values():
            found = pattern.match(str(entry[0]))
            if found:
                return int(found.group(1))
        return None

    @contextlib.contextmanager
    def cut(self) -> Generator[None]:
        """The layer list holds its first ``STAMPED`` layers until the block ends."""
        whole = self.container._modules  # pyright: ignore[reportPrivateUsage]
        self.container._modules = dict(list(whole.items())[:STAMPED])  # pyright: ignore[reportPrivateUsage]
        try:
            yield
        finally:
            self.container._modules = whole  # pyright: ignore[reportPrivateUsage]

    def rename(self, text: str, a: int, b: int) -> str:
        """``text`` with layer ``a``'s prefix, dotted (tensor names) or underscored (value names), made ``b``'s."""
        under = self.path.replace(".", "_")
        return text.replace(f"{self.path}.{a}.", f"{self.path}.{b}.").replace(f"{under}_{a}_", f"{under}_{b}_")

    def shifted(self, v: AttrValue, a: int, b: int) -> AttrValue:
        if isinstance(v, SymbolRef):
            return SymbolRef(self.rename(v.name, a, b))
        if isinstance(v, str):
            return self.rename(v, a, b)
        if isinstance(v, list):
            return [self.shifted(x, a, b) for x in v]
        if isinstance(v, dict):
            return {k: self.shifted(x, a, b) for k, x in v.items()}
        return v


def repeated_layers(model: nn.Module, config: Any) -> Layers | None:
    """The layer list to stamp (see the module docstring), or ``None``: export the model whole."""
    family = LAYERS.get(str(getattr(config, "model_type", "")))
    if family is None or not family[1](config):
        return None
    path, _ = family
    found = dict(model.named_modules()).get(PREFIX + path)
    if not isinstance(found, nn.ModuleList) or len(found) < MIN_LAYERS:
        return None
    layers = list(found)
    if not uniform_config(config, len(layers)) or not all(same_layer(layers[1], other) for other in layers[2:]):
        return None
    return Layers(found, path)


class NotStamped(Exception):
    """Layer 2 is not layer 1 shifted, or the graph is not prefix, layers, head: export whole."""


@dataclass
class Lowered:
    """A lowered program before its names are numbered: each op's layer (``None``: outside the
    layers), each value named after an FX node, and where each tensor-table name's bytes are."""

    module: Module
    tags: list[int | None]
    named: dict[Value, Origin]
    lazy: dict[str, Any] = field(default_factory=dict[str, Any])


Place = tuple[str, Any]
"""How a copy finds an operand: ("own", (op, result)) of its layer, ("previous", (op, result)) of the
layer before, or ("shared", the value)."""


def stamp(low: Lowered, layers: Layers) -> Module:
    """``low`` (the cut model, lowered) with layers 3..``layers.count - 1`` made from layer 1 (see the
    module docstring); raises ``NotStamped``."""
    m = low.module
    if len(m.graphs) != 1:
        raise NotStamped("more than one graph")
    g = m.graphs[0]
    spans = regions(low.tags)
    where = {
        v: (r, i - spans[r][0], j)
        for r, (s, e) in enumerate(spans)
        for i in range(s, e)
        for j, v in enumerate(g.ops[i].results)
    }
    one, two = g.ops[slice(*spans[2])], g.ops[slice(*spans[3])]
    if len(one) != len(two):
        raise NotStamped("layers 1 and 2 lower to different numbers of ops")
    places = [check_op(t, u, layers, where, low.named) for t, u in zip(one, two, strict=True)]
    order = first_uses(g.ops)
    if order != list(m.tensors):
        raise NotStamped("the tensor table is not in the order of first use")
    ops = g.ops[: spans[3][0]]
    prev = one
    for k in range(2, layers.count):
        prev = copy_layer(one, places, prev, k, layers, low.named)
        ops += prev
    for op in g.ops[slice(*spans[4])]:
        op.operands = [tail_operand(v, where, prev) for v in op.operands]
        ops.append(op)
    g.ops = ops
    made = {layers.rename(n, 1, k): (n, k) for k in range(3, layers.count) for n in first_uses(one)}
    m.tensors = stamped_tensors(m, first_uses(ops), made, low.lazy, layers)
    renumber(g, low.named)
    return m


def regions(tags: list[int | None]) -> list[tuple[int, int]]:
    """The op spans of: before the layers, layers 0, 1, 2, after them."""
    spans: list[tuple[int, int]] = []
    i = 0
    for want in (None, 0, 1, 2, None):
        j = i
        while j < len(tags) and tags[j] == want:
            j += 1
        spans.append((i, j))
        i = j
    if i != len(tags) or any(s == e for s, e in spans[1:4]):
        raise NotStamped("the layers' ops are not three runs between the embedding and the head")
    return spans


def check_op(
    t: Op, u: Op, layers: Layers, where: dict[Value, tuple[int, int, int]], named: dict[Value, Origin]
) -> list[Place]:
    """Layer 2's op ``u`` is layer 1's ``t`` shifted; returns where each of ``t``'s operands comes from."""
    if (
        t.name != u.name
        or len(t.operands) != len(u.operands)
        or [r.type for r in t.results] != [r.type for r in u.results]
        or layers.shifted(t.attrs, 1, 2) != u.attrs
        or [layers.rename(c, 1, 2) for c in t.comments] != u.comments
        or t.loc != u.loc
    ):
        raise NotStamped(f"{t.describe()} of layer 1 is not {u.describe()} of layer 2")
    for vt, vu in zip(t.results, u.results, strict=True):
        ot, ou = named.get(vt), named.get(vu)
        same = (
            ot[1:] == ou[1:]
            if ot is not None and ou is not None
            else ot is ou and layers.rename(vt.name, 1, 2) == vu.name
        )
        if not same:
            raise NotStamped(f"value %{vt.name} of layer 1 is not %{vu.name} of layer 2")
    places: list[Place] = []
    for a, b in zip(t.operands, u.operands, strict=True):
        ra, rb = where.get(a), where.get(b)
        if ra is not None and ra[0] == 2 and rb is not None and rb[0] == 3 and ra[1:] == rb[1:]:
            places.append(("own", ra[1:]))
        elif ra is not None and ra[0] == 1 and rb is not None and rb[0] == 2:
            places.append(("previous", rb[1:]))
        elif a is b and (ra is None or ra[0] in (0, 1)):
            places.append(("shared", a))
        else:
            raise NotStamped(f"an operand of {t.describe()} in layer 1 does not come from where layer 2's does")
    return places


def copy_layer(
    one: list[Op], places: list[list[Place]], prev: list[Op], k: int, layers: Layers, named: dict[Value, Origin]
) -> list[Op]:
    out: list[Op] = []
    for t, where in zip(one, places, strict=True):
        operands = [
            out[p[0]].results[p[1]] if kind == "own" else prev[p[0]].results[p[1]] if kind == "previous" else p
            for kind, p in where
        ]
        names = [r.name if r in named else layers.rename(r.name, 1, k) for r in t.results]
        op = create_op(t.name, operands, [r.type for r in t.results], layers.shifted(t.attrs, 1, k), names)  # pyright: ignore[reportArgumentType]
        op.comments = [layers.rename(c, 1, k) for c in t.comments]
        op.loc = t.loc
        for r, c in zip(t.results, op.results, strict=True):
            if r in named:
                node, base, suffix = named[r]
                named[c] = ((k, node), base, suffix)
        out.append(op)
    return out


def tail_operand(v: Value, where: dict[Value, tuple[int, int, int]], last: list[Op]) -> Value:
    r = where.get(v)
    if r is None or r[0] in (0, 1, 4):
        return v
    if r[0] == 3:
        return last[r[1]].results[r[2]]
    raise NotStamped("the head reads a layer other than the last")


def first_uses(ops: Iterable[Op]) -> list[str]:
    """Tensor-table names in the order ops first name them."""
    seen: dict[str, None] = {}

    def walk(v: AttrValue) -> None:
        if isinstance(v, SymbolRef):
            seen.setdefault(v.name)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    for op in ops:
        for v in op.attrs.values():
            walk(v)
    return list(seen)


def stamped_tensors(
    m: Module, order: list[str], made: dict[str, tuple[str, int]], lazy: dict[str, Any], layers: Layers
) -> dict[str, TensorDecl]:
    """The tensor table of the stamped graph: the cut model's entries, and for each copied layer's
    name (``made``: -> the layer-1 entry it copies, the layer) the source's, of the copied entry's dtype and shape."""
    out: dict[str, TensorDecl] = {}
    for name in order:
        decl = m.tensors.get(name)
        if decl is None:
            copied, k = made[name]
            template = m.tensors[copied]
            ref = lazy.get(name)
            if ref is None or ref.dtype != template.blob.dtype or tuple(ref.shape) != tuple(template.blob.shape):
                raise NotStamped(f"the source's tensor {name} is not a copy of {template.name}'s dtype and shape")
            attrs = {a: layers.shifted(v, 1, k) for a, v in template.attrs.items()}
            decl = TensorDecl(name, ref, attrs, [layers.rename(c, 1, k) for c in template.comments], template.loc)
        out[name] = decl
    return out


def stamped(layers: Layers, export: Callable[[], Any], lower: Callable[[Any, Layers], Lowered]) -> Module | None:
    """The model's module from an export of its first ``STAMPED`` layers (``export`` runs while the
    layer list is cut; ``lower`` tags each op with its layer), or ``None``: export it whole. Whatever
    fails here (the cut model's export or lowering too) is left to the whole export to raise."""
    from qcompiler.ir.verifier import verify_module

    try:
        with layers.cut():
            program = export()
        m = stamp(lower(program, layers), layers)
        verify_module(m)
        return m
    except Exception:  # NotStamped, or anything the whole export will meet and report itself
        return None


def used_by_layers(model: nn.Module, config: Any, run: Callable[[], set[str]]) -> set[str]:
    """``run()``: the modules of ``model`` whose output is used (``source_info.used_modules``), run on
    the model cut to ``STAMPED`` layers when its layers repeat: layer 0 stands for itself, layer 1
    for every layer between the first and the last, layer 2 for the last."""
    layers = repeated_layers(model, config)
    if layers is None:
        return run()
    with layers.cut():
        got = run()
    head = f"{PREFIX}{layers.path}."
    last = layers.count - 1
    out: set[str] = set()
    for name in got:
        if not name.startswith(head):
            out.add(name)
            continue
        index, dot, rest = name[len(head) :].partition(".")
        k = int(index)
        stands = [0] if k == 0 else range(1, last) if k == 1 else [last]
        out.update(f"{head}{j}{dot}{rest}" for j in stands)
    return out
