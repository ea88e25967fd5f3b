"""Attention masks, recognised by evaluation rather than by matching their construction.

transformers builds masks from arange/index/cumsum/``&`` subgraphs that change between releases. We
run the exported program at several sequence lengths (and random padding masks), record what each
``scaled_dot_product_attention`` receives as ``attn_mask``, and check it against the forms QIR
states directly:

| form | QIR |
|---|---|
| no mask | ``sdpa(q, k, v) {causal = <is_causal>}`` |
| causal (lower triangle) | ``sdpa(q, k, v) {causal = true}`` |
| padding from input ``m`` | ``sdpa(q, k, v, reshape(cast(m, bool), [B,1,1,S]))`` |
| causal and padding | both of the above |
| sliding window (with either) | ``sdpa(q, k, v) {causal = true, window = W}`` |

``qcompiler::softcapped_sdpa`` (``softcap.py``, Gemma2's soft-capped attention) is recognised the
same way and lowers to the same ``sdpa``, with its ``scale`` and ``softcap``.

A window shows only at lengths beyond it, so a model whose config declares one (``sliding_window``)
is also evaluated at a length past its window (``window_sizes``).

A mask that matches none of them stops the compile, naming the attention op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram

from qcompiler.frontend.context import UnsupportedError, where_from
from qcompiler.frontend.softcap import SOFTCAPPED
from qcompiler.ir.ops.attention import keep_mask

SDPA = torch.ops.aten.scaled_dot_product_attention.default
ATTENTION = (SDPA, SOFTCAPPED)
"""Attention ops whose ``attn_mask`` (argument 3 of each) is recognised and which lower to ``sdpa``."""


@dataclass(frozen=True)
class MaskForm:
    causal: bool
    padding_input: int | None
    """Index of the user input that is the padding mask, if any."""
    window: int | None = None
    """A sliding window (causal only): a query sees only the last ``window`` keys."""


def attention_window(config: object) -> int | None:
    """The sliding attention window a transformers config declares and uses (Mistral's, Gemma2/3's and
    Phi-3's ``sliding_window``; Qwen2's only with ``use_sliding_window``), when shorter than the
    context (``None`` otherwise: it never takes effect)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or not isinstance(window, int) or window <= 0:
        return None
    context = getattr(config, "max_position_embeddings", None)
    return window if not isinstance(context, int) or window < context else None


def window_sizes(config: object) -> tuple[int, ...]:
    """Sequence lengths past the config's sliding window, where the mask recogniser sees it."""
    window = attention_window(config)
    if window is None:
        return ()
    context = getattr(config, "max_position_embeddings", None)
    return (min(window + 3, context) if isinstance(context, int) else window + 3,)


def mask_arg(n: fx.Node) -> Any:
    return n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")


def mask_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes every SDPA's ``attn_mask`` depends on: all the recorder evaluates (masks come from
    the inputs' shapes and values, never from weights, so the model may hold no weight data)."""
    stack = [a for n in graph.nodes if n.target in ATTENTION for a in [mask_arg(n)] if isinstance(a, fx.Node)]
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.masks: dict[str, torch.Tensor | None] = {}
        self.needed = mask_nodes(gm.graph)

    def run_node(self, n: fx.Node) -> Any:
        if n.target in ATTENTION:
            arg = mask_arg(n)  # held, not copied: layers share one mask node, and nothing mutates it
            self.masks[n.name] = self.env[arg] if isinstance(arg, fx.Node) else None
            return None
        if n.op in ("placeholder", "output") or n in self.needed:
            return super().run_node(n)
        return None


def as_keep(mask: torch.Tensor) -> torch.Tensor:
    """Boolean 'may attend' form of a bool or additive float mask."""
    return mask if mask.dtype == torch.bool else mask == 0


def _matches(mask: torch.Tensor, form: MaskForm, inputs: Sequence[torch.Tensor]) -> bool:
    keep = as_keep(mask)
    s_q, s_k = keep.shape[-2], keep.shape[-1]
    want = torch.ones(s_q, s_k, dtype=torch.bool)
    if form.causal:
        want = keep_mask(s_q, s_k, form.window)
    if form.padding_input is not None:
        pad = inputs[form.padding_input].bool()
        want = want[None, None] & pad[:, None, None, :]
    try:
        return torch.equal(keep, want.expand_as(keep)) or torch.equal(keep.expand_as(want), want)
    except RuntimeError:
        return False


def candidate_forms(inputs: Sequence[torch.Tensor], windows: Sequence[int] = ()) -> list[MaskForm]:
    pads = [
        i
        for i, x in enumerate(inputs)
        if x.dim() == 2 and not x.is_floating_point() and bool(((x == 0) | (x == 1)).all())
    ]
    forms = [MaskForm(True, None)]
    for i in pads:
        forms += [MaskForm(False, i), MaskForm(True, i)]
    return forms + [MaskForm(True, f.padding_input, w) for w in windows for f in forms if f.causal]


def recognize_masks(
    ep: ExportedProgram, variants: list[list[torch.Tensor]], windows: Sequence[int] = ()
) -> dict[str, MaskForm | None]:
    """For every attention node (``ATTENTION``): the mask form that explains its ``attn_mask`` on all ``variants``
    (``None`` when the node gets no mask); ``windows``: sliding windows to try (the variants must
    include a length past each)."""
    gm = ep.module()
    runs: list[tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]] = []
    with torch.no_grad():
        for inputs in variants:
            rec = _Recorder(gm)  # type: ignore[arg-type]
            rec.run(*inputs)
            runs.append((inputs, rec.masks))
    by_name = {n.name: n for n in ep.graph.nodes}
    out: dict[str, MaskForm | None] = {}
    seen: dict[tuple[int, MaskForm], bool] = {}

    def matched(mask: torch.Tensor, form: MaskForm, inputs: Sequence[torch.Tensor]) -> bool:
        """``_matches``, once per mask tensor (layers share one) and form."""
        key = (id(mask), form)
        if key not in seen:
            seen[key] = _matches(mask, form, inputs)
        return seen[key]

    for name in runs[0][1]:
        masks = [(inputs, rec[name]) for inputs, rec in runs]
        if all(m is None for _, m in masks):
            out[name] = None
            continue
        forms = candidate_forms(variants[0], windows)
        found = next((f for f in forms if all(m is not None and matched(m, f, i) for i, m in masks)), None)
        if found is None:
            node = by_name.get(name)
            where = where_from(node) if node is not None else name
            raise UnsupportedError(
                f"attention op {name} gets a mask that is neither causal nor a padding mask from an input "
                f"(checked at {len(variants)} sequence lengths): {where}"
            )
        out[name] = found
    return out


def lower_sdpa(lx: Any, n: fx.Node) -> Any:
    """Lower one SDPA node using the mask form recognised for it (``lx.rewrites[n]``)."""
    is_causal = bool(n.args[5]) if len(n.args) > 5 else bool(n.kwargs.get("is_causal", False))
    scale: Any = n.kwargs.get("scale")
    return emit_sdpa(lx, n, is_causal, None if scale is None else float(scale), None)


def lower_softcapped(lx: Any, n: fx.Node) -> Any:
    """``softcapped_sdpa(q, k, v, mask, scale, softcap)``: ``sdpa {scale, softcap}`` with its mask's form."""
    scale, softcap = n.args[4], n.args[5]
    assert isinstance(scale, float | int)
    assert isinstance(softcap, float | int)
    return emit_sdpa(lx, n, False, float(scale), float(softcap))


def emit_sdpa(lx: Any, n: fx.Node, is_causal: bool, scale: float | None, softcap: float | None) -> Any:
    """``sdpa`` of the node's q, k, v, with the mask form recognised for it (``lx.rewrites[n]``)."""
    from qcompiler.ir.attrs import AttrValue
    from qcompiler.ir.dtypes import DTYPES
    from qcompiler.ir.types import DenseType

    q, k, v = (lx.value(a) for a in n.args[:3])
    form: MaskForm | None = lx.rewrites.get(n)
    attrs: dict[str, AttrValue] = {"causal": is_causal or (form is not None and form.causal)}
    if form is not None and form.window is not None:
        attrs["window"] = form.window
    if scale is not None:
        attrs["scale"] = scale
    if softcap is not None:
        attrs["softcap"] = softcap
    operands = [q, k, v]
    if form is not None and form.padding_input is not None:
        src = lx.graph.args[form.padding_input]
        b, s = src.type.shape
        keep = lx.emit("cast", [src], DenseType(DTYPES["bool"], (b, s)), {"dtype": DTYPES["bool"]}, name="attn_keep")
        shape: list[AttrValue] = [str(b) if isinstance(b, str) else b, 1, 1, str(s) if isinstance(s, str) else s]
        operands.append(
            lx.emit("reshape", [keep], DenseType(DTYPES["bool"], (b, 1, 1, s)), {"shape": shape}, name="attn_mask")
        )
    return lx.emit("sdpa", operands, lx.type_of(n), attrs, name=n.name)
