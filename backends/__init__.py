"""Backends: one package each, registered by name in a lazy table (imported on first use).

| target | emits | loaded by |
|---|---|---|
| ``safetensors`` | compressed-tensors ``pack-quantized`` checkpoint + config.json | transformers, vLLM |
| ``gguf`` | a GGUF v3 model file (llama, bert) | llama.cpp |
| ``onnx-nbits`` (``onnx``), ``onnx-qdq`` | an ONNX model + external data (MatMulNBits, or QDQ) | onnxruntime |
| ``triton`` | weights in ``triton-kn`` + generated Triton kernels (``kernels/``) | ``qcompiler.load(device="cuda")`` |

A backend is a ``qcompiler.backends.base.Backend`` subclass; ``get_backend("safetensors")`` returns
an instance. A new target adds one row here.
"""

from __future__ import annotations

import importlib

from qcompiler.backends.base import Backend
from qcompiler.errors import UsageError

BACKENDS: dict[str, str] = {
    "safetensors": "qcompiler.backends.safetensors.backend:SafetensorsBackend",
    "gguf": "qcompiler.backends.gguf.backend:GgufBackend",
    "onnx": "qcompiler.backends.onnx.backend:OnnxBackend",
    "onnx-nbits": "qcompiler.backends.onnx.backend:OnnxBackend",
    "onnx-qdq": "qcompiler.backends.onnx.backend:OnnxQdqBackend",
    "triton": "qcompiler.backends.triton.backend:TritonBackend",
}


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``UsageError`` listing the known targets otherwise."""
    target = BACKENDS.get(name)
    if target is None:
        raise UsageError(f"unknown target {name!r} (known: {', '.join(BACKENDS)})")
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    assert isinstance(cls, type)
    assert issubclass(cls, Backend)
    return cls()


__all__ = ["BACKENDS", "Backend", "get_backend"]
