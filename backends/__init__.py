"""Backends: one package each, found through the ``qcompiler.backends`` entry-point group.

| target | emits | loaded by |
|---|---|---|
| ``safetensors`` | compressed-tensors ``pack-quantized`` checkpoint + config.json | transformers, vLLM |
| ``gguf`` | a GGUF v3 model file (llama, bert) | llama.cpp |
| ``onnx-nbits`` (``onnx``), ``onnx-qdq`` | an ONNX model + external data (MatMulNBits, or QDQ) | onnxruntime |
| ``triton`` | weights in ``triton-kn`` + generated Triton kernels (``kernels/``) | ``qcompiler.load(device="cuda")`` |

A backend is a ``qcompiler.backends.base.Backend`` subclass; ``get_backend("safetensors")`` returns
an instance. A new backend is one folder whose ``__init__`` declares its targets, layouts, blob
schemes and source files (``qcompiler.plugins``), plus one entry-point line in ``pyproject.toml``;
nothing outside its folder names it.
"""

from __future__ import annotations

from qcompiler import plugins
from qcompiler.backends.base import Backend
from qcompiler.errors import UsageError


def targets() -> dict[str, str]:
    """Every ``--target`` name -> its ``Backend`` class, as the backend packages declare them."""
    return plugins.declared("TARGETS")


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``UsageError`` listing the known targets otherwise."""
    target = targets().get(name)
    if target is None:
        raise UsageError(f"unknown target {name!r} (known: {', '.join(targets())})")
    cls = plugins.provide(target)
    assert isinstance(cls, type)
    assert issubclass(cls, Backend)
    return cls()


__all__ = ["Backend", "get_backend", "targets"]
