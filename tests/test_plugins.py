"""Backends declare what they give the core (``qcompiler/plugins.py``): targets, code layouts, blob
location schemes, single-file sources and runtime kernels, found through the ``qcompiler.backends`` entry points."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest

from qcompiler import plugins
from qcompiler.backends import get_backend, targets
from qcompiler.backends.base import Backend
from qcompiler.errors import UsageError
from qcompiler.ir import blobs
from qcompiler.ir.layouts import Layout, all_layouts, find_layout
from qcompiler.runtime import cpu_kernels, kernels


def test_our_backends_are_found_through_the_entry_point_group() -> None:
    names = [p.__name__ for p in plugins.packages()]
    assert names == sorted(names)
    assert {"qcompiler.backends.safetensors", "qcompiler.backends.gguf"} <= set(names)
    assert {"safetensors", "gguf", "onnx", "onnx-nbits", "onnx-qdq", "triton"} <= set(targets())


@pytest.mark.parametrize("name", sorted(plugins.declared("TARGETS")))
def test_each_declared_target_is_a_backend(name: str) -> None:
    assert isinstance(get_backend(name), Backend)


@pytest.mark.parametrize("key", sorted(plugins.declared("LAYOUTS")))
def test_each_declared_layout_registers_itself(key: tuple[str, int]) -> None:
    layout = find_layout(*key)
    assert layout is not None
    assert issubclass(layout, Layout)
    assert (layout.family, layout.version) == key
    assert all_layouts()[key] is layout


@pytest.mark.parametrize("scheme", sorted(plugins.declared("BLOB_SCHEMES")))
def test_each_declared_blob_scheme_registers_its_reader(scheme: str) -> None:
    plugins.provide(plugins.declared("BLOB_SCHEMES")[scheme])
    assert scheme in blobs.READERS


def test_declared_sources_are_callables() -> None:
    assert callable(plugins.provide(plugins.declared("SOURCE_FILES")[".gguf"]))


def test_an_unknown_layout_is_none_and_an_unknown_target_names_the_known_ones() -> None:
    assert find_layout("no-such-layout", 1) is None
    with pytest.raises(UsageError, match=r"unknown target 'npz'.*safetensors"):
        get_backend("npz")


def test_two_backends_declaring_one_key_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = types.ModuleType("x_backend_a"), types.ModuleType("x_backend_b")
    a.LAYOUTS = {("dup", 1): ".layouts"}  # type: ignore[attr-defined]
    b.LAYOUTS = {("dup", 1): ".other"}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "x_backend_a", a)
    monkeypatch.setattr(plugins, "packages", lambda: (a, b))
    plugins.declared.cache_clear()
    try:
        with pytest.raises(UsageError, match=r"LAYOUTS \('dup', 1\) is declared by both x_backend_a and x_backend_b"):
            plugins.declared("LAYOUTS")
    finally:
        monkeypatch.undo()
        plugins.declared.cache_clear()
    assert ("dup", 1) not in plugins.declared("LAYOUTS")


def test_providers_are_relative_to_their_package() -> None:
    assert plugins.absolute("qcompiler.backends.gguf", ".source:load") == "qcompiler.backends.gguf.source:load"
    assert plugins.absolute("pkg", "elsewhere.mod") == "elsewhere.mod"
    with pytest.raises(ValueError, match="unknown declaration table"):
        plugins.declared("PASSES")


CORE_ORDER = [
    "cpu.int4pack-bf16",
    "cpu.int8pack-bf16",
    "cpu.int4pack",
    "cpu.mixprec",
    "cpu.int8pack",
    "cpu.embedding-rows",
    "cpu.reference",
    "cpu.reference-embedding",
    "cpu.dequant",
    "cuda.dequant",
    "cpu.dequant-embedding",
    "cuda.dequant-embedding",
]
PACKED = 6
"""The core's packed kernels, first in ``CORE_ORDER``."""


def test_the_kernel_registry_is_the_core_table_in_preference_order() -> None:
    assert {k.id for k in cpu_kernels.KERNELS} == set(CORE_ORDER)
    assert [k.id for k in kernels.registry() if k.id in CORE_ORDER] == CORE_ORDER  # packed, reference, fallback
    assert plugins.declared("KERNELS") == {}  # no in-tree backend declares one (triton's are per artifact)


def with_kernel_table(monkeypatch: pytest.MonkeyPatch, declared: dict[str, str]) -> None:
    """A backend package declaring ``KERNELS`` = ``declared``, over a table holding one test kernel."""
    spec = replace(cpu_kernels.KERNELS[0], id="x.test")
    pkg = types.ModuleType("x_backend_k")
    pkg.KERNELS = declared  # type: ignore[attr-defined]
    table = types.ModuleType("x_backend_k.kernels")
    table.KERNELS = (spec,)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "x_backend_k", pkg)
    monkeypatch.setitem(sys.modules, "x_backend_k.kernels", table)
    monkeypatch.setattr(plugins, "packages", lambda: (pkg,))
    plugins.declared.cache_clear()
    kernels.registry.cache_clear()


def test_a_backend_declared_kernel_reaches_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kernel_table(monkeypatch, {"x.test": ".kernels:KERNELS"})
    try:
        ids = [k.id for k in kernels.registry()]
        assert ids == [*CORE_ORDER[:PACKED], "x.test", *CORE_ORDER[PACKED:]]  # after the core's packed kernels
    finally:
        monkeypatch.undo()
        plugins.declared.cache_clear()
        kernels.registry.cache_clear()
    assert "x.test" not in [k.id for k in kernels.registry()]


def test_a_kernel_id_missing_from_its_declared_table_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kernel_table(monkeypatch, {"x.other": ".kernels"})  # a module: its KERNELS
    try:
        with pytest.raises(UsageError, match=r"KERNELS 'x.other' is declared as x_backend_k.kernels, which holds"):
            kernels.registry()
    finally:
        monkeypatch.undo()
        plugins.declared.cache_clear()
        kernels.registry.cache_clear()


def test_a_kernel_registered_at_run_time_joins_the_registry_once() -> None:
    spec = replace(cpu_kernels.KERNELS[0], id="x.runtime")
    try:
        assert kernels.ensure_registered(spec) is spec
        assert kernels.ensure_registered(replace(spec, error_bound=1.0)) is spec  # the one registered
        assert [k.id for k in kernels.registry()][: PACKED + 1] == [*CORE_ORDER[:PACKED], "x.runtime"]
        with pytest.raises(ValueError, match=r"kernel x\.runtime registered twice"):
            kernels.register(spec)
    finally:
        kernels.registry.cache_clear()
    assert "x.runtime" not in [k.id for k in kernels.registry()]


@pytest.mark.parametrize("op", sorted(plugins.declared("LOWERINGS")))
def test_each_declared_lowering_is_found_by_the_op_it_names(op: str) -> None:
    import torch

    from qcompiler.frontend.capture import declared_lowering
    from qcompiler.frontend.lowerings import LOWERINGS

    plugins.provide(plugins.declared("LOWERINGS")[op])  # the module defining the op and its lowering
    namespace, _, name = op.partition("::")
    target = getattr(getattr(torch.ops, namespace), name).default
    assert declared_lowering(target) is LOWERINGS[target]


def test_an_op_no_backend_declares_has_no_declared_lowering() -> None:
    import torch

    from qcompiler.frontend.capture import declared_lowering

    assert declared_lowering(torch.ops.aten.add.Tensor) is None
    assert declared_lowering("not an op") is None
