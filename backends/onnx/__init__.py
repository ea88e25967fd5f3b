"""The ``onnx`` targets: whole-model ONNX graphs for onnxruntime, quantized weights as QDQ or MatMulNBits.

Its declarations (``qcompiler.plugins``): the targets, the ``onnx-kn`` and ``ort-nbits`` code layouts,
and the ``onnx:`` blob location scheme."""

TARGETS = {"onnx": ".backend:OnnxBackend", "onnx-nbits": ".backend:OnnxBackend", "onnx-qdq": ".backend:OnnxQdqBackend"}
LAYOUTS = {("onnx-kn", 1): ".layouts", ("ort-nbits", 1): ".layouts"}
BLOB_SCHEMES = {"onnx": ".blobs"}
