"""A mixture of experts in a GGUF file, as llama.cpp's `convert_hf_to_gguf.py` writes one (Mixtral as `llama`,
Qwen2-MoE as `qwen2moe`, Qwen3-MoE as `qwen3moe`): each layer's per-expert linears stacked into one (E, out, in)
tensor per weight (`blk.N.ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), the router (`ffn_gate_inp`) and the
shared expert's gate kept in float32, and the experts' counts and sizes in the metadata."""

from __future__ import annotations

import torch

from lora_llama.errors import UserError
from lora_llama.loading.gguf_mixtures import RENORMALISES
from lora_llama.lora.experts import EXPERT_WEIGHTS, expert_factors
from lora_llama.model.config import ModelArgs
from lora_llama.model.moe import stacked_name

F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # routers: float32 in every file type


class StackedExperts:
    """The per-expert linears of a checkpoint streamed tensor by tensor, gathered into the stacked tensors llama.cpp
    reads (`model.layers.N.mlp.experts.gate_proj.weight`, ...), each handed on once its last expert arrives; every
    other tensor passes straight through. Values are tensors, or shapes (tensor infos come before the data)."""

    def __init__(self, args: ModelArgs):
        self.experts = args.moe.num_experts if args.moe is not None else 0
        self.pieces: dict[str, dict] = {}

    def add(self, key: str, value) -> list[tuple[str, object]]:
        found = stacked_name(key) if self.experts else None
        if found is None:
            return [(key, value)]
        name, expert, part = found
        stack = f"{name.rsplit('.', 1)[0]}.{part}_proj.weight"
        got = self.pieces.setdefault(stack, {})
        got[expert] = value
        if len(got) < self.experts:
            return []
        del self.pieces[stack]
        items = [got[e] for e in range(self.experts)]
        stacked = torch.stack(items) if isinstance(items[0], torch.Tensor) else (self.experts, *items[0])
        return [(stack, stacked)]


def check_every_layer_mixed(args: ModelArgs, arch: str) -> None:
    """llama.cpp's mixture architectures read a mixture in every layer, and renormalise the chosen experts'
    weights or not by architecture: a model with dense layers, or routing otherwise, is one line."""
    moe = args.moe
    dense = [i for i in range(args.n_layers) if moe is not None and i not in moe.sparse_layers]
    if dense:
        raise UserError(
            f"llama.cpp's {arch} reads a mixture of experts in every layer; layer {dense[0]} of this "
            f"{args.model_type} model is dense (mlp_only_layers / decoder_sparse_step), so it has no GGUF form"
        )
    if moe is not None and arch in RENORMALISES and moe.norm_topk_prob != RENORMALISES[arch]:
        raise UserError(
            f"llama.cpp's {arch} {'renormalises' if RENORMALISES[arch] else 'does not renormalise'} the chosen "
            f"experts' weights; this {args.model_type} model has norm_topk_prob {str(moe.norm_topk_prob).lower()}, "
            "so it has no GGUF form"
        )


def write_expert_hparams(writer, args: ModelArgs) -> None:
    """The experts' metadata the converter writes: their count and the count each token uses, and for the Qwen
    families each expert's (and the shared expert's) feed-forward size."""
    moe = args.moe
    if moe is None:
        return
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    if args.model_type != "mixtral":  # Mixtral's experts are its feed_forward_length
        writer.add_expert_feed_forward_length(moe.expert_dim)
    if moe.shared_expert_dim:
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_dim)


def expert_lora_tensors(key: str, A: torch.Tensor, B: torch.Tensor, args: ModelArgs) -> list:
    """An adapter's stacked expert factors (peft's: A (r·E, in), B (out, r·E)) for `model.layers.N.mlp.experts.
    gate_up_proj` / `down_proj`, as llama.cpp's LoRA reads a stacked expert tensor's (`ggml_mul_mat_id` on both):
    [(name, lora_a (E, r, in), lora_b (E, out, r))] under the checkpoint-side names of the stacks export writes;
    gate_up's B splits into gate's rows and up's, both with the same A. [] for any other weight."""
    if args.moe is None or not key.endswith(tuple(f"experts.{w}.weight" for w in EXPERT_WEIGHTS)):
        return []
    a, b = expert_factors(A, B, args.moe.num_experts)
    b = b.permute(2, 0, 1)  # (E, out, r)
    stack = key.removesuffix(".weight").rsplit(".", 1)[0]  # model.layers.N.mlp.experts
    if key.endswith("down_proj.weight"):
        return [(f"{stack}.down_proj.weight", a, b)]
    half = b.shape[1] // 2
    return [(f"{stack}.gate_proj.weight", a, b[:, :half]), (f"{stack}.up_proj.weight", a, b[:, half:])]
