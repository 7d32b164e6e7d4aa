"""What a family adds to an exported GGUF beyond the common metadata, as llama.cpp's converter writes it and its
loader reads it: Gemma 3 (`gemma3`: its norms stored as 1 + weight, the sliding window and which layers use it,
the sliding layers' RoPE base) and linear RoPE scaling."""

from __future__ import annotations

import torch

from lora_llama.errors import UserError
from lora_llama.model.config import ModelArgs

LLAMA_CPP_SWA_EVERY = 6  # llama.cpp's gemma3 default: every 6th layer global, unless the file says otherwise
LLAMA_CPP_SWA_BASE = 10000.0  # llama.cpp's RoPE base of sliding layers, unless the file says otherwise


def write_family_hparams(writer, args: ModelArgs) -> None:
    import gguf

    scaling = args.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":  # as the converter's rope_scaling: linear
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    if not args.gemma:
        return
    check_attention_scale(args)
    writer.add_sliding_window(args.local_window)
    sliding = [i in args.local_layers for i in range(args.n_layers)]
    if sliding != [(i + 1) % LLAMA_CPP_SWA_EVERY != 0 for i in range(args.n_layers)]:
        writer.add_sliding_window_pattern(sliding)
    if args.local_rope_theta != LLAMA_CPP_SWA_BASE:
        writer.add_rope_freq_base_swa(args.local_rope_theta)


def check_attention_scale(args: ModelArgs) -> None:
    """llama.cpp's gemma3 scales queries by head_dim^-1/2 (27B: (hidden / heads)^-1/2), not by the config's
    query_pre_attn_scalar: a model it would compute otherwise is one line."""
    llama_cpp = args.dim / args.n_heads if args.n_layers == 62 else args.head_dim
    if args.query_scale != llama_cpp:
        raise UserError(
            f"llama.cpp's gemma3 scales attention by {llama_cpp:g}^-1/2; this model's query_pre_attn_scalar is "
            f"{args.query_scale:g}, so it has no GGUF form"
        )


def family_layout(args: ModelArgs, hf_name: str, w: torch.Tensor) -> torch.Tensor:
    """Gemma's norms hold weight where they compute 1 + weight; llama.cpp's gemma3 multiplies by what it reads."""
    return w.float() + 1 if args.gemma and hf_name.endswith("norm.weight") else w
