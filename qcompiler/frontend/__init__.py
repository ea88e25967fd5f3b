"""The frontend: PyTorch models (plain modules, transformers Llama/BERT, quantized by
``qcompiler.quantize``, torchao or PT2E) into QIR."""

from qcompiler.frontend.capture import capture

__all__ = ["capture"]
