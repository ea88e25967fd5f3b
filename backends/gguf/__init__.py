"""GGUF backend (llama.cpp): the ggml type table, block codecs and a strict reader. The writer and the
``--target gguf`` registration land with the rest of the GGUF issue."""
