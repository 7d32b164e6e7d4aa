"""The native LLaMA family: its configuration per family, the model, decoding with a KV cache, sampling.

It knows nothing of LoRA."""
