"""safetensors + compressed-tensors backend: checkpoints transformers and vLLM load.

Its declarations (``qcompiler.plugins``): the ``safetensors`` target, the ``ct-pack-quantized`` code
layout, and the ``safetensors:`` / ``ct-zero:`` blob location schemes."""

TARGETS = {"safetensors": ".backend:SafetensorsBackend"}
LAYOUTS = {("ct-pack-quantized", 1): ".layouts"}
BLOB_SCHEMES = {"safetensors": ".blobs", "ct-zero": ".blobs"}
