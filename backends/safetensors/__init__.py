"""safetensors + compressed-tensors backend: checkpoints transformers and vLLM load.

Its declarations (``qcompiler.plugins``): the ``safetensors`` target, the ``ct-pack-quantized`` and
``ct-float8`` code layouts, the ``safetensors:`` / ``ct-zero:`` / ``ct-scale:`` blob location
schemes, the reader of an HF-style directory's safetensors shards (``frontend/checkpoint.py``),
and the readers of pre-quantized directories by ``quant_method`` (``prequant_formats.py``)."""

TARGETS = {"safetensors": ".backend:SafetensorsBackend"}
LAYOUTS = {("ct-pack-quantized", 1): ".layouts", ("ct-float8", 1): ".layouts"}
BLOB_SCHEMES = {"safetensors": ".blobs", "ct-zero": ".blobs", "ct-scale": ".blobs"}
CHECKPOINTS = {"safetensors": ".source"}
PREQUANTIZED = {
    "gptq": ".prequant_formats:load_gptq",
    "awq": ".prequant_formats:load_awq",
    "compressed-tensors": ".prequant_formats:load_ct",
}
