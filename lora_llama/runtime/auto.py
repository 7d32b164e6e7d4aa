"""What each `auto` setting picks on this machine, and every device setting checked: the device, the precision a
run trains in (`fp32`, or `bf16-mixed`: frozen base weights, activations and products in bfloat16 with float32
accumulation; norms, softmax and the loss in float32; LoRA A/B and the optimizer state in float32),
`model.quantize` and `train.compile`.
"""

from __future__ import annotations

import re

from lora_llama.errors import UserError
from lora_llama.kernels.cpu import cpu_bf16_instructions
from lora_llama.model.config import DEVICE


def resolve_device(setting: str) -> str:
    """The device a setting names, checked here: `auto` is cuda when a GPU is there, else cpu; cuda (or cuda:N)
    must exist. One line for anything else, before any work."""
    import torch

    if not re.fullmatch(DEVICE, setting):
        raise UserError(f"unknown device {setting!r} (use auto, cpu, cuda or cuda:N)")
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(setting.partition(":")[2] or 0)
        if index >= count:
            raise UserError(
                f"device {setting}: this machine has {count} CUDA GPU{'' if count == 1 else 's'} "
                f"visible to torch {torch.__version__}"
            )
    return setting


def resolve_precision(setting: str, device: str) -> tuple[str, str]:
    """(fp32 | bf16-mixed, why): `auto` is bf16-mixed on a GPU with bf16 and on a CPU with native bf16."""
    import torch

    if setting == "bf16-mixed" and device == "cpu" and not cpu_bf16_instructions():
        return (
            setting,
            "set in the recipe; this CPU lacks AVX512_BF16 and AMX, so its bf16 products are "
            "emulated, many times slower than fp32",
        )
    if setting != "auto":
        return setting, "set in the recipe"
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", "auto: this GPU supports bfloat16"
        return "fp32", "auto: this GPU has no bfloat16"
    found = cpu_bf16_instructions()
    if found:
        return "bf16-mixed", f"auto: this CPU has {' and '.join(found)}"
    return "fp32", "auto: this CPU has no native bfloat16 (AVX512_BF16 / AMX)"


def base_dtype(precision: str, model_dtype):
    """The frozen base weights' dtype: bfloat16 under bf16-mixed, else the recipe's model.dtype."""
    import torch

    return torch.bfloat16 if precision == "bf16-mixed" else model_dtype


def resolve_quantize(setting: str | None, precision: str, device: str, gguf: bool, base_moves: bool):
    """(quantize kind or None, why). `auto` keeps a GGUF base's own blocks (`source`) where the products run in
    float32 on the CPU: the same model as its dequantized copy (equal logits), measured faster and smaller there
    (the default recipe on a 2-core AVX2 EPYC: 1.08-1.12x the tokens/s, 0.94-0.95 of the peak). Native bf16
    products run several times faster while dequantizing does not, so bf16-mixed, GPUs, other bases and inits
    that move the base (PiSSA, OLoRA) train the unquantized copy."""
    if setting != "auto":
        return setting, "set in the recipe"
    if not gguf:
        return None, "auto: the base is no GGUF file"
    if base_moves:
        return None, "auto: lora.init_lora_weights changes the base, which source would keep as the file's blocks"
    if precision != "fp32" or device != "cpu":
        return None, f"auto: {precision} on {device}; the file's blocks train faster only in float32 on the CPU"
    return "source", "auto: float32 on the CPU trains the file's own blocks faster than their float32 copy"


def resolve_compile(setting: bool | str, device: str, sharded: bool) -> tuple[bool, str]:
    """(compile the decoder blocks?, why). `auto` compiles on a GPU, where a small model's eager step waits on the
    host's kernel launches and a large one's on unfused elementwise passes: a compiled block is one graph with its
    norms, RoPE, SwiGLU and LoRA terms fused (its first step compiles, seconds to minutes). The CPU keeps its
    hand-written kernels, which save less for backward; fsdp's sharded blocks stay eager."""
    if setting != "auto":
        return bool(setting), "set in the recipe"
    if not device.startswith("cuda"):
        return False, f"auto: {device} runs the hand-written kernels"
    if sharded:
        return False, "auto: fsdp's sharded blocks run eager"
    return True, "auto: each decoder block one compiled graph on the GPU"


# below this many parameters a GPU training step is a few milliseconds of work, about what launching its kernels
# one by one from Python costs (135M at 4 x 512: 190-260 ms eager on an H100)
SMALL_MODEL = 2_000_000_000


def compile_options(parameters: int, device: str, gradient_checkpointing) -> dict:
    """torch.compile's options for the decoder blocks: on a GPU, a small model's compiled blocks are also
    replayed as CUDA graphs (mode reduce-overhead; rows come in a few padded lengths, each its graph), taking the
    host out of its step; not with activation checkpointing, whose recomputation runs outside the graphs."""
    if device.startswith("cuda") and parameters < SMALL_MODEL and not gradient_checkpointing:
        return {"mode": "reduce-overhead"}
    return {}
