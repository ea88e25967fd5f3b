"""Backends declare what they give the core (``qcompiler/plugins.py``): targets, code layouts, blob
location schemes and single-file sources, found through the ``qcompiler.backends`` entry points."""

from __future__ import annotations

import sys
import types

import pytest

from qcompiler import plugins
from qcompiler.backends import get_backend, targets
from qcompiler.backends.base import Backend
from qcompiler.errors import UsageError
from qcompiler.ir import blobs
from qcompiler.ir.layouts import Layout, all_layouts, find_layout


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
        plugins.declared("KERNELS")
