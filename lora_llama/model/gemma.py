"""What Gemma 3 (text) does differently, read off transformers' modeling_gemma3.py: RMSNorm scaled by 1 + weight,
and the block's sandwich of norms (each sub-layer's output normed again before it joins the residual). The
rest (scaled embeddings, gelu-tanh MLP, q / k norms, the query's own scale, sliding-window and global layers with
their own RoPE bases) is a setting of the shared classes in llama.py."""

from __future__ import annotations

import torch
import torch.nn as nn

from lora_llama.kernels.elementwise import rms_norm
from lora_llama.model.linears import kept


class GemmaRMSNorm(nn.Module):
    """x / rms(x) · (1 + weight), in float32 (the weight starts at zero)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)


class SandwichBlock(nn.Module):
    """x + post_attention_layernorm(attn(input_layernorm(x))), then
    x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, dim: int, eps: float):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, x, cos, sin, mask, cache=None, lean: bool = False, keep=None, segments=None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, keep, segments)
        x = kept(x, keep) + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), lean))
