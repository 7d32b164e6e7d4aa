"""lora-llama: LoRA fine-tuning for LLaMA-family models on a native PyTorch LLaMA.

Names are imported lazily so that `lora-llama --help` does not pay for torch.
"""
import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "load_model": "checkpoint", "load_tokenizer": "checkpoint", "load_adapter": "adapters",
    "save_adapter": "adapters", "LoraSettings": "recipe", "ModelArgs": "config", "Recipe": "recipe",
    "load_recipe": "recipe", "UserError": "errors", "LoRALinear": "lora", "apply_lora": "lora",
    "merge_lora": "lora",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'lora_llama' has no attribute {name!r}")
