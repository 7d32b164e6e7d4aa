"""lora-llama: LoRA fine-tuning for LLaMA-family models on a native PyTorch LLaMA.

Names are imported lazily so that `lora-llama --help` does not pay for torch.
"""

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "load_model": "loading.models",
    "load_tokenizer": "loading.models",
    "load_adapter": "loading.adapters",
    "save_adapter": "loading.adapters",
    "LoraSettings": "lora.settings",
    "ModelArgs": "model.config",
    "Recipe": "recipe.schema",
    "load_recipe": "recipe.schema",
    "UserError": "errors",
    "LoRALinear": "lora.layer",
    "apply_lora": "lora.adapted",
    "merge_lora": "lora.adapted",
    "adapters_disabled": "lora.adapted",
    "target_loss": "objectives.token_losses",
    "generate": "model.generate",
    "train_from_recipe": "training.from_recipe",
    "merge_checkpoint": "outputs.merge",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'lora_llama' has no attribute {name!r}")
