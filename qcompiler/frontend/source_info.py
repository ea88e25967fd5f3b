"""What a checkpoint artifact needs from the source besides the graph.

- ``used_modules``: the modules whose output reaches the model's output (gradients on the example
  inputs), so ``--scheme`` quantizes only weights the graph uses; an unused Linear (BERT's pooler
  under ``last_hidden_state``) stays float and is carried as it is.
- ``checkpoint_state``: the model's checkpoint tensors (parameters, tied ones once, and persistent
  buffers), taken before quantization.
- ``mark_roles``: a tied parameter captured under its other name (``lm_head.weight``) is renamed
  to the name the checkpoint keeps (``model.embed_tokens.weight``); tensor-table entries the
  checkpoint does not hold (a non-persistent rotary buffer, a lifted constant) get
  ``role = "constant"``; checkpoint tensors the graph never reads are added with
  ``role = "carried"``, so the artifact is a complete checkpoint.
- ``source_info``: config.json, tokenizer files (verbatim), source sha256 and revision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qcompiler.artifact.manifest import TOKENIZER_FILES, digests_sha256
from qcompiler.artifact.request import SourceInfo
from qcompiler.frontend.context import to_numpy
from qcompiler.frontend.hf import PREFIX, Capturable
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.blobs import put_array
from qcompiler.ir.core import BlobRef, Module, Op, TensorDecl
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.ops.quant import SourceWeight, Weight
from qcompiler.ir.ops.quant_blocks import SourceBlocks
from qcompiler.ir.ops.quant_mixprec import SourceMixprec
from qcompiler.ir.symbols import rename_tensor
from qcompiler.paths import SOURCE, read_bounded, sha256_in

WEIGHT_GLOBS = ("*.safetensors", "*.bin")
MAX_CARRIED_BYTES = 256 * 2**20
"""Largest tokenizer or generation file carried from a source (a large tokenizer.json is ~20 MB)."""


def hf_model(cap: Capturable) -> nn.Module | None:
    inner = getattr(cap.module, PREFIX.rstrip("."), None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "config") else None


def used_modules(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> set[str]:
    """Qualified names of the modules whose output reaches the model's output on ``inputs``.

    A module can run without mattering: BERT computes its pooler even when only
    ``last_hidden_state`` is returned, and torch.export drops it. The autograd graph tells them
    apart: a module's output is used iff the output's gradient would reach it, i.e. its ``grad_fn``
    is reachable from the output's (walked, not run: no backward pass).
    """
    produced: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(_mod: nn.Module, _args: object, out: object) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                produced[name] = out

        return record

    handles = [mod.register_forward_hook(hook(name)) for name, mod in model.named_modules() if name]
    try:
        with torch.enable_grad():
            result = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    if not isinstance(result, torch.Tensor) or not produced:
        return set(produced)
    reached: set[int] = set()  # grad_fn nodes, and the leaf tensors their AccumulateGrad nodes feed
    stack = [result.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in reached:
            continue
        reached.add(id(fn))
        leaf = getattr(fn, "variable", None)
        if isinstance(leaf, torch.Tensor):
            reached.add(id(leaf))
        stack.extend(f for f, _ in fn.next_functions)
    return {n for n, out in produced.items() if id(out.grad_fn if out.grad_fn is not None else out) in reached}


def checkpoint_state(model: nn.Module, skip: tuple[type[nn.Module], ...] = ()) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by name, the buffers of modules of the ``skip``
    types left out (frozen quantized modules: their ``q.weight`` covers their codes and qparams)."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, skip):
            continue
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{b_name}" if mod_name else b_name] = b.detach()
    return out


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """The sha256 of a model's state: every tensor's name, dtype, shape and bytes, in name order. A
    tensor subclass (a torchao-quantized weight) is hashed as what it stores: its inner tensors
    (``__tensor_flatten__``: codes, scales, zero points), each under ``name.part``, and its
    metadata (block size, target dtype) as text."""
    digest = hashlib.sha256()
    for name in sorted(state):
        for part, t, meta in stored_parts(name, state[name]):
            arr, dtype = to_numpy(t)
            digest.update(f"{part}\0{dtype}\0{list(arr.shape)}\0{meta}".encode())
            digest.update(np.ascontiguousarray(arr).tobytes())
    return digest.hexdigest()


def stored_parts(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor, str]]:
    """``(name, plain tensor, metadata text)`` of what ``t`` stores: itself, or a subclass's inner
    tensors (recursively), the first carrying the subclass's metadata."""
    t = t.detach()
    flatten = getattr(t, "__tensor_flatten__", None)
    if type(t) in (torch.Tensor, nn.Parameter) or flatten is None:
        return [(name, t, "")]
    inner, ctx = flatten()
    out: list[tuple[str, torch.Tensor, str]] = [(name, torch.empty(0), f"{type(t).__name__}{ctx!r}")]
    for attr in inner:
        out += stored_parts(f"{name}.{attr}", getattr(t, attr))
    return out


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every other name of a tied parameter -> the name the checkpoint keeps (the first one)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(p), name)
        if canonical != name:
            out[name] = canonical
    return out


def weight_name(op: Op) -> str:
    """``model.layers.0.mlp.up_proj.weight`` from a weight op's ``codes`` (or ``blocks``) tensor."""
    if isinstance(op, SourceBlocks):
        ref = op.blocks
    else:
        assert isinstance(op, Weight | SourceWeight | SourceMixprec)  # mark_roles asks only for the weight ops
        ref = op.codes
    return str(ref).removeprefix("@").removesuffix(".codes").removesuffix(".blocks")


def mark_roles(
    m: Module,
    state: Mapping[str, torch.Tensor | None],
    aliases: dict[str, str],
    lazy: Mapping[str, BlobRef] | None = None,
) -> None:
    """Name tied tensors by their checkpoint name, tag graph-only tensors ``role = "constant"``, and
    add unused checkpoint tensors as ``carried`` (from ``lazy``, where a streamed source's bytes are,
    when the model holds no data)."""
    for alias, canonical in aliases.items():
        if alias in m.tensors and canonical not in m.tensors:
            rename_tensor(m, alias, canonical)
    quant_parts = {
        ref.name: weight_name(op)
        for op in m.ops()
        if op.name in ("q.weight", "q.source_weight", "q.source_blocks", "q.source_mixprec")
        for ref in op.attrs.values()
        if isinstance(ref, SymbolRef)
    }
    covered = set(quant_parts.values())
    for name, decl in m.tensors.items():
        if name in quant_parts:
            continue
        covered.add(name)
        if name not in state:
            decl.attrs["role"] = "constant"
    for name, t in state.items():
        if name in covered:
            continue
        ref = (lazy or {}).get(name)
        if ref is None:
            assert t is not None
            arr, dtype = to_numpy(t)
            ref = put_array(arr, DTYPES[dtype])
        m.tensors[name] = TensorDecl(name, ref, {"role": "carried"})


def source_info(
    spec: str, cap: Capturable, state: dict[str, torch.Tensor], streamed: Mapping[str, str] | None = None
) -> SourceInfo:
    """``streamed``: sha256 of the weight files the streaming frontend read (each read only once)."""
    model = hf_model(cap)
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        from qcompiler.frontend.hf_dir import read_config

        files = {n: read_bounded(path, n, MAX_CARRIED_BYTES, SOURCE) for n in TOKENIZER_FILES if (path / n).is_file()}
        known = streamed or {}
        weights = {
            p.name: known.get(p.name) or sha256_in(path, p.name, SOURCE)
            for g in WEIGHT_GLOBS
            for p in sorted(path.glob(g))
        }
        config: dict[str, Any] = read_config(path)
        revision = path.name if path.parent.name == "snapshots" else "unversioned local directory"
        return SourceInfo(spec, config, files, digests_sha256(weights) or state_sha256(state), revision)
    if model is None:
        return SourceInfo(spec, None, {}, state_sha256(state), f"factory {spec}")
    cfg: Any = model.config
    config = dict(cfg.to_dict())
    config["architectures"] = [type(model).__name__]
    return SourceInfo(spec, config, {}, state_sha256(state), f"factory {spec}")
