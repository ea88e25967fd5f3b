"""The ``onnx`` targets: whole-model ONNX graphs for onnxruntime, quantized weights as QDQ or MatMulNBits."""
