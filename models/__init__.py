"""Model definitions (Flax), loaders (GGUF, safetensors), tokenizer and shape-only specs."""
