"""Backends (safetensors, gguf, onnx, triton) register here by declaration; none has landed yet."""
