"""safetensors + compressed-tensors backend: checkpoints transformers and vLLM load."""
