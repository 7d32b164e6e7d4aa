"""lora-llama: LoRA fine-tuning for LLaMA-family models on a native PyTorch LLaMA."""
from .checkpoint import load_model, load_tokenizer
from .config import LoraSettings, ModelArgs, Recipe, load_recipe
from .errors import UserError

__all__ = ["load_model", "load_tokenizer", "LoraSettings", "ModelArgs", "Recipe", "load_recipe", "UserError"]
__version__ = "0.1.0"
