"""Turn generated kernel source into Triton functions, without touching the disk.

The source is registered in ``linecache`` under a synthetic file name (Triton's ``@triton.jit`` reads
a function's source through ``inspect``), then compiled and executed in a fresh namespace. With
``interpret`` the functions are decorated under Triton's CPU interpreter (``TRITON_INTERPRET`` is read
when ``@triton.jit`` runs, so the knob is switched for the decoration only).
"""

from __future__ import annotations

import linecache
from types import ModuleType
from typing import Any

import triton

from qcompiler.backends.triton.codegen import KernelKey, generate, source_sha256

LOADED: dict[tuple[str, bool], ModuleType] = {}


def kernel_module(key: KernelKey, interpret: bool = False) -> ModuleType:
    """The generated module for ``key`` (cached per process), its kernels ``@triton.jit`` functions."""
    return load_source(key.id, generate(key), interpret)


def load_source(kid: str, source: str, interpret: bool = False) -> ModuleType:
    """Generated ``source`` of kernel ``kid`` as a module (cached per process by the source's sha256)."""
    cache_key = (source_sha256(source), interpret)
    if cache_key in LOADED:
        return LOADED[cache_key]
    filename = f"<qcompiler-kernel {kid} {cache_key[0][:12]}{' interpret' if interpret else ''}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = ModuleType(f"qcompiler_kernels_{kid}")
    module.__file__ = filename
    knobs: Any = getattr(triton, "knobs").runtime  # noqa: B009  # untyped in the stubs
    before = knobs.interpret
    knobs.interpret = interpret
    try:
        exec(compile(source, filename, "exec"), module.__dict__)  # our own codegen's text, never an artifact's
    finally:
        knobs.interpret = before
    LOADED[cache_key] = module
    return module
