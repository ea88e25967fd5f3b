"""``capture(model, example_inputs)``: a PyTorch module -> a verified QIR module.

Steps: ``torch.export.export`` (non-strict, dynamic dims named by the caller) ->
``run_decompositions({})`` (functional, subclasses flattened, nothing decomposed; skipped when the
exported graph is functional already, ``functional_as_exported``) -> attention
masks recognised by evaluation -> the nodes the outputs need, lowered in graph order through
``LOWERINGS``. Parameters, buffers and constants become tensor-table entries named by their
qualified names; quantized weights become ``q.source_weight`` ops for ``freeze-semantics``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import Dim, ExportedProgram
from torch.fx import config as fx_config

from qcompiler import plugins
from qcompiler.frontend.context import Lowering, UnsupportedError, where_from
from qcompiler.frontend.hf import PREFIX
from qcompiler.frontend.hf_attention import softcapped_attention
from qcompiler.frontend.lowerings import DROPPED, LOWERINGS, Lower
from qcompiler.frontend.masks import (
    ATTENTION,
    SDPA,
    SOFTCAPPED,
    attention_window,
    lower_sdpa,
    lower_softcapped,
    recognize_masks,
    window_sizes,
)
from qcompiler.frontend.names import origins, renumber
from qcompiler.frontend.quant_sources import register_optional
from qcompiler.frontend.stamp import Layers, Lowered, repeated_layers, stamped
from qcompiler.frontend.variants import input_variants
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.core import BlobRef, Module, Value
from qcompiler.ir.verifier import verify_module
from qcompiler.quant.experts import unfuse_experts

LOWERINGS[SDPA] = lower_sdpa
LOWERINGS[SOFTCAPPED] = lower_softcapped

DynamicSpec = Mapping[str, Mapping[int, str | tuple[str, int, int]]]
"""``{"input_ids": {1: "seq"}}`` or ``{"input_ids": {1: ("seq", 2, 512)}}`` (name, min, max)."""


def export_program(
    model: nn.Module, inputs: Sequence[torch.Tensor], dynamic: DynamicSpec, *, traces: bool = False
) -> ExportedProgram:
    """``model`` exported on ``inputs``; ``traces``: record each node's Python stack (``stack_trace``),
    which only an error message reads and which cost about a tenth of a large model's export, so
    ``capture`` exports again with them when a lowering fails (``lowered``)."""
    names = list(inspect.signature(model.forward).parameters)[: len(inputs)]
    inputs = distinct_inputs(inputs)
    dims: dict[str, Dim] = {}
    shapes: dict[str, dict[int, Any]] = {}
    for arg, spec in dynamic.items():
        if arg not in names:
            raise UnsupportedError(f"dynamic dims name input '{arg}', but forward takes {names}")
        for axis, d in spec.items():
            name, lo, hi = (d, 2, 4096) if isinstance(d, str) else d
            dims.setdefault(name, Dim(name, min=lo, max=hi))
            shapes.setdefault(arg, {})[axis] = dims[name]
    dynamic_shapes = {n: shapes.get(n) for n in names} if shapes else None
    from qcompiler.env import QC_DEBUG

    untraced = fx_config.do_not_emit_stack_traces
    try:
        fx_config.do_not_emit_stack_traces = not traces
        with torch.no_grad(), softcapped_attention(hf_config(model)):
            ep = torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic_shapes, strict=False)
        return ep if functional_as_exported(ep) else ep.run_decompositions({})
    except Exception as e:
        if QC_DEBUG.level() >= 1:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise UnsupportedError(
            f"torch.export cannot capture {type(model).__name__}: {type(e).__name__}: {first} "
            "(rerun with QC_DEBUG=1 for the traceback)"
        ) from None
    finally:
        fx_config.do_not_emit_stack_traces = untraced


def distinct_inputs(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``inputs`` with every tensor that is the same object as an earlier one replaced by a copy.
    torch.export gives such a repeat no placeholder of its own (``f(x, x)`` exports ``a @ a.T`` for
    ``a @ b.T``, its graph then right only while both are one tensor); a copy keeps each argument its
    own input. Views of one storage are distinct objects and export apart already."""
    out: list[torch.Tensor] = []
    for x in inputs:
        out.append(x.clone() if any(x is y for y in out) else x)
    return out


def functional_as_exported(ep: ExportedProgram) -> bool:
    """Whether ``run_decompositions({})`` could only rename nodes (it re-traces the whole graph: 60%
    of a large model's export): no input is mutated, no tensor is a subclass (a fake tensor, the
    weightless capture's, is a plain tensor's stand-in), and no op mutates. Functionalisation then
    has nothing to rewrite but views and copies (``reshape`` into ``view``, a same-dtype ``to`` into
    nothing), which lower alike; ops no lowering knows (the mask arithmetic that ``recognize_masks``
    evaluates) are the same ops either way."""
    sig = ep.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        return False
    tensors = [*ep.state_dict.values(), *ep.constants.values()]
    if any(type(t) not in PLAIN_TENSORS for t in tensors if isinstance(t, torch.Tensor)):
        return False
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is None or schema.is_mutable:
            return False
    return True


PLAIN_TENSORS = (torch.Tensor, nn.Parameter, FakeTensor)


def symbol_names(ep: ExportedProgram, dynamic: DynamicSpec, names: list[str]) -> dict[str, str]:
    """torch symbol (``s27``) -> our dim name (``seq``), read from the user inputs' shapes."""
    out: dict[str, str] = {}
    users = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    for node, arg in zip(users, names, strict=False):
        val = node.meta.get("val")
        for axis, d in dynamic.get(arg, {}).items():
            sym = val.shape[axis] if isinstance(val, torch.Tensor) else None
            if isinstance(sym, torch.SymInt):
                out[str(sym.node.expr)] = d if isinstance(d, str) else d[0]
    return out


def resolve_constants(lx: Lowering) -> None:
    sig, ep = lx.ep.graph_signature, lx.ep
    tables: list[tuple[Mapping[str, str], Mapping[str, Any]]] = [
        (sig.inputs_to_parameters, ep.state_dict),
        (sig.inputs_to_buffers, {**ep.state_dict, **ep.constants}),
        (sig.inputs_to_lifted_tensor_constants, ep.constants),
    ]
    for mapping, store in tables:
        for placeholder, fqn in mapping.items():
            t = store.get(fqn)
            if isinstance(t, torch.Tensor):
                lx.consts[placeholder] = t
                name = fqn.removeprefix(PREFIX)
                lx.const_names[placeholder] = lx.tied.get(name, name)


def tied_tensors(model: nn.Module) -> dict[str, str]:
    """Each other name of a parameter or buffer registered under several module paths -> its first
    name (the one a checkpoint keeps: ``lm_head.weight`` -> ``model.embed_tokens.weight``). The export
    may name a tied parameter by either; a streamed source holds only the first."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, b in named:
        name = name.removeprefix(PREFIX)
        canonical = first.setdefault(id(b), name)
        if canonical != name:
            out[name] = canonical
    return out


def needed_nodes(lx: Lowering) -> set[fx.Node]:
    """Nodes the outputs depend on, not following the masks of recognised attention ops."""
    out_node = next(n for n in lx.ep.graph.nodes if n.op == "output")
    seen: set[fx.Node] = set()
    stack = [out_node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        inputs = [a for a in n.args[:3] if isinstance(a, fx.Node)] if n.target in ATTENTION else n.all_input_nodes
        stack.extend(inputs)
    return seen


def declared_lowering(target: Any) -> Lower | None:
    """The lowering a backend declares for ``target``, an op it defines (``LOWERINGS`` of
    ``qcompiler.plugins``, keyed by the op's name): its module is imported, which registers it."""
    name = target.name() if isinstance(target, torch._ops.OpOverload) else None  # pyright: ignore[reportPrivateUsage, reportUnknownMemberType]
    ref = plugins.declared("LOWERINGS").get(name) if name else None
    if ref is None:
        return None
    plugins.provide(ref)
    return LOWERINGS.get(target)


def lower_node(lx: Lowering, n: fx.Node) -> None:
    if n.op != "call_function" or n.target in DROPPED:
        return  # placeholders are lowered on first use; constants only where a dense value is needed
    fn = LOWERINGS.get(n.target) or declared_lowering(n.target)
    if fn is None:
        raise UnsupportedError(f"unsupported op {n.target} ({n.name}): {where_from(n)}")
    v = fn(lx, n)
    if v is not None:
        lx.values[n] = v


def flatten(arg: Any) -> list[fx.Node]:
    if isinstance(arg, fx.Node):
        return [arg]
    if isinstance(arg, list | tuple):
        return [x for a in arg for x in flatten(a)]  # type: ignore[misc]
    return []


def weight_sources(model: nn.Module) -> dict[str, str]:
    """``{weight name: "kind type via op"}`` for modules that record where their codes came from (and
    ``, from Conv1D [K, N]`` for a weight its checkpoint holds transposed: ``quant/conv1d.py``)."""
    out: dict[str, str] = {}
    for fqn, mod in model.named_modules():
        source = getattr(mod, "source", None)
        if isinstance(source, dict):
            parts = [str(v) for k, v in source.items() if k in ("kind", "type", "scheme")]  # pyright: ignore[reportUnknownVariableType]
            op = getattr(mod, "decode_op", None) or (
                "dequantize_affine_gidx" if getattr(mod, "g_idx", None) is not None else "dequantize_affine"
            )
            orientation = f", {source['orientation']}" if "orientation" in source else ""  # a Conv1D's [K, N]
            out[f"{fqn.removeprefix(PREFIX)}.weight"] = " ".join(parts) + f" via qcompiler.{op}{orientation}"
    return out


def config_hash(model: nn.Module) -> str:
    to_json = getattr(getattr(model, "config", None), "to_json_string", None)
    text = str(to_json()) if callable(to_json) else json.dumps(repr(model))
    return hashlib.sha256(text.encode()).hexdigest()


def capture(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    dynamic: DynamicSpec | None = None,
    name: str = "model",
    provenance: Mapping[str, AttrValue] | None = None,
    effective: Mapping[str, torch.Tensor] | None = None,
    lazy: Mapping[str, BlobRef] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    exported: ExportedProgram | None = None,
) -> Module:
    """Export ``model`` on ``example_inputs`` and lower it to a verified QIR module.

    ``dynamic`` names dynamic dims per forward argument, e.g. ``{"input_ids": {1: "seq"}}``; they stay
    dynamic (``?seq``) in the IR. ``effective`` maps weight names to the source library's own
    dequantized weights when they are known (torchao adoption passes them). A model without weight
    data (the streaming frontend's) passes ``lazy``, where each tensor-table entry's bytes already
    are, and ``buffers``, the real values of buffers no source holds; ``exported``: ``model``'s
    program when ``export_program`` has run already.
    """
    dyn = dynamic or {}
    unfuse_experts(model)  # a transformers MoE block as a static graph (quant/experts.py); else nothing
    config = hf_config(model)
    with contextlib.suppress(NotImplementedError):  # exported GraphModules (PT2E) refuse it; they are eval already
        model.eval()
    register_optional()
    with no_kv_cache(config):  # the config's use_cache is back on however this ends
        prov: dict[str, AttrValue] = {
            "capture": "torch.export",
            "torch": torch.__version__,
            "model": type(model).__name__,
        }
        prov.update(provenance or {})
        prov["config_sha256"] = config_hash(getattr(model, "model", model))

        def lower(program: ExportedProgram, layers: Layers | None = None) -> Lowered:
            m = Module(name, attrs={"invariants": [], "provenance": dict(prov)})
            tags = None if layers is None else layers.layer_of
            return lowered(program, m, model, example_inputs, dyn, effective, lazy, buffers, tags)

        layers = repeated_layers(model, config) if exported is None and lazy is not None else None
        if layers is not None:
            m = stamped(layers, lambda: export_program(model, example_inputs, dyn), lower)
            if m is not None:
                return m
        ep = exported if exported is not None else export_program(model, example_inputs, dyn)
        try:
            return finished(lower(ep))
        except UnsupportedError:
            if any(n.meta.get("stack_trace") for n in ep.graph.nodes):
                raise
        # the program was exported without stack traces: export again with them, so that the error names
        # the source line (``where_from``); what fails there is what failed above
        return finished(lower(export_program(model, example_inputs, dyn, traces=True)))


def finished(low: Lowered) -> Module:
    """A lowered program with its values numbered (``names.py``), verified."""
    renumber(low.module.graphs[0], low.named)
    verify_module(low.module)
    return low.module


def hf_config(model: nn.Module) -> Any:
    """The transformers config of ``model``, of the model a ``Capturable`` wrapper holds, or ``None``."""
    for m in (model, getattr(model, "hf", None), getattr(model, "model", None)):
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            return cfg
    return None


@contextlib.contextmanager
def no_kv_cache(config: Any) -> Generator[None]:
    """``use_cache`` off while a transformers model is exported (as the README's snippet calls it): a
    causal LM would otherwise return its ``DynamicCache``, which torch.export cannot flatten. QIR's
    graph is the cacheless forward; a target that wants a KV cache builds its own variant."""
    before = getattr(config, "use_cache", None)
    if before:
        config.use_cache = False
    try:
        yield
    finally:
        if before:
            config.use_cache = before


def lowered(
    ep: ExportedProgram,
    m: Module,
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    dyn: DynamicSpec,
    effective: Mapping[str, torch.Tensor] | None,
    lazy: Mapping[str, BlobRef] | None,
    buffers: Mapping[str, torch.Tensor] | None,
    layer_of: Callable[[fx.Node], int | None] | None = None,
) -> Lowered:
    """``ep`` lowered into ``m`` (a new module), its names not yet numbered; ``layer_of``: tag each op
    with the layer its node ran in (``stamp.py``)."""
    names = list(inspect.signature(model.forward).parameters)[: len(example_inputs)]
    lx = Lowering(ep, m, symbol_names(ep, dyn, names))
    lx.effective = effective or {}  # read weight by weight (a pre-quantized source's is computed then)
    lx.lazy.update(lazy or {})
    lx.buffers.update(buffers or {})
    lx.sources.update(weight_sources(model))
    lx.tied.update(tied_tensors(model))
    resolve_constants(lx)
    for node, arg in zip(
        [n for n in ep.graph.nodes if n.op == "placeholder" and n.name not in lx.consts], names, strict=False
    ):
        v = Value(arg, lx.type_of(node))
        lx.graph.args.append(v)
        lx.values[node] = v
    if any(n.target in ATTENTION for n in ep.graph.nodes):
        config = hf_config(model)
        extra = window_sizes(config)
        window = attention_window(config)
        variants = input_variants(example_inputs, names, dyn, extra=extra)
        forms = recognize_masks(ep, variants, (window,) if window is not None else ())
        lx.rewrites.update({n: forms.get(n.name) for n in ep.graph.nodes if n.target in ATTENTION})
    needed = needed_nodes(lx)
    tags: list[int | None] = []
    for n in ep.graph.nodes:
        if n in needed:
            lower_node(lx, n)
            tags += [layer_of(n) if layer_of is not None else None] * (len(lx.graph.ops) - len(tags))
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outs = [lx.value(a) for a in flatten(out_node.args[0])]
    lx.emit_none("return", outs)
    tags.append(None)
    m.graphs.append(lx.graph)
    fx_names = {n.name: n for n in ep.graph.nodes if n.op == "call_function"}
    return Lowered(m, tags, origins(lx.graph.values(), fx_names), lx.lazy)
