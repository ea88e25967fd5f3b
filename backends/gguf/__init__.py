"""GGUF backend (llama.cpp): the ggml type table, block codecs, layouts, a strict reader and writer.

Its declarations (``qcompiler.plugins``): the ``gguf`` target, the ``ggml`` and ``ggml-k`` code
layouts, the ``gguf:`` blob location scheme, and ``.gguf`` files as SOURCEs."""

TARGETS = {"gguf": ".backend:GgufBackend"}
LAYOUTS = {("ggml", 1): ".layouts", ("ggml-k", 1): ".layouts_k"}
BLOB_SCHEMES = {"gguf": ".blobs"}
SOURCE_FILES = {".gguf": ".source:load_gguf_source"}
