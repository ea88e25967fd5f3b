"""safetensors + compressed-tensors backend: checkpoints transformers and vLLM load.

Its declarations (``qcompiler.plugins``): the ``safetensors`` target, the ``ct-pack-quantized`` code
layout, the ``safetensors:`` / ``ct-zero:`` blob location schemes, and the reader of an HF-style
directory's safetensors shards (``frontend/checkpoint.py``)."""

TARGETS = {"safetensors": ".backend:SafetensorsBackend"}
LAYOUTS = {("ct-pack-quantized", 1): ".layouts"}
BLOB_SCHEMES = {"safetensors": ".blobs", "ct-zero": ".blobs"}
CHECKPOINTS = {"safetensors": ".source"}
