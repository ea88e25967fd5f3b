"""GGUF backend (llama.cpp): the ggml type table, block codecs, layouts, a strict reader and writer.

Its declarations (``qcompiler.plugins``): the ``gguf`` target, the ``ggml`` and ``ggml-k`` code
layouts, the ``gguf:`` blob location scheme, ``.gguf`` files as SOURCEs, llama.cpp's quantization
schemes for the built-in quantizer (``schemes.py``) and the frontend's lowering of the ggml dequantize
op its quantized modules call (``lowering.py``)."""

TARGETS = {"gguf": ".backend:GgufBackend"}
LAYOUTS = {("ggml", 1): ".layouts", ("ggml-k", 1): ".layouts_k"}
BLOB_SCHEMES = {"gguf": ".blobs"}
SOURCE_FILES = {".gguf": ".source:load_gguf_source"}
SCHEMES = dict.fromkeys(
    ("q8_0", "q4_0", "q5_0", "q4_1", "q5_1", "q4_k", "q5_k", "q6_k", "tq1_0", "tq2_0", "q4_k_m", "q5_k_m"),
    ".schemes:GGML",
)
LOWERINGS = {"qcompiler::dequantize_ggml": ".lowering"}
