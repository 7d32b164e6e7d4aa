"""A native LLaMA in one file: RMSNorm pre-norm, RoPE, grouped-query attention, SwiGLU, KV cache.

The architecture only: the hand-written backward passes live in kernels/elementwise.py and kernels/low_rank.py,
attention's in kernels/attention.py, and nothing here knows about LoRA (a module's `projection` of the layers that
read one input is theirs to replace: linears.py).

Module names follow Hugging Face's `LlamaForCausalLM` exactly
(`model.layers.0.self_attn.q_proj`, ...), so a checkpoint's state dict loads
without renaming and LoRA adapters map 1:1 onto PEFT keys. q/k weights stay in
HF's rotate-half RoPE layout (no permutation).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lora_llama.kernels.attention import attend, takes_segments
from lora_llama.kernels.elementwise import apply_rope, recompute_when_saved, rms_norm, silu_mul, swiglu
from lora_llama.kernels.fused import compiled, strict_compiling
from lora_llama.model.cache import KVCache, StaticKVCache
from lora_llama.model.config import ModelArgs, rope_inv_freq
from lora_llama.model.gemma import GemmaRMSNorm, SandwichBlock
from lora_llama.model.linears import each_layer, kept, run_linear
from lora_llama.model.moe import SparseMoE

# attention's forward kernels (ours on the CPU, SDPA's flash / efficient / cuDNN): quadratic in the length to
# recompute, linear to keep, so selective checkpointing keeps their outputs and recomputes the rest of the block
_ATTENTION_KERNELS = {torch.ops.lora_llama.causal_attention.default} | {
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
}


def _keep_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_attention)


def offloaded(active: bool, device: torch.device):
    """While active on a CUDA device, tensors saved for backward wait in pinned host memory (copied back in
    backward); on the CPU there is nowhere cheaper to put them, so nothing changes."""
    if active and device.type == "cuda" and torch.is_grad_enabled():
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


def attention_mask(T: int, start: int, device, segment_ids=None, key_mask=None, window: int | None = None):
    """Which keys each query sees: None for plain causal attention, for packed rows on the CPU
    (segment_ids (B, T): attend runs each example on its own, without a (T, T) mask), and for one new
    token that sees every key; else (1 or B, 1, T, start + T) bool, built once for all layers: causal,
    inside the sliding window (Mistral), inside its own example, past the row's left padding (key_mask
    (B, start + T)). window: the layer's sliding window, if any."""
    windowed = window is not None and start + T > window
    plain = segment_ids is None or takes_segments(device)
    if not windowed and (start == 0 or T == 1) and plain and key_mask is None:
        return None
    if not windowed and T == 1 and key_mask is not None:  # one new token sees every key but its row's padding
        return key_mask[:, None, None, : start + 1]
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    k_pos = torch.arange(start + T, device=device)[None]
    mask = k_pos <= q_pos  # (T, start + T)
    if windowed:
        mask &= k_pos > q_pos - window
    if key_mask is not None:  # a padding query sees itself alone: no row without a key (its output is unused)
        return ((mask & key_mask[:, None, : start + T]) | (k_pos == q_pos))[:, None]  # (B, 1, T, start + T)
    if segment_ids is not None:
        return (mask & (segment_ids[:, :, None] == segment_ids[:, None, :]))[:, None]  # (B, 1, T, T)
    return mask[None, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(
            args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias
        )  # Qwen2: q, k, v biased, o not
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        if args.qk_norm:  # Qwen3, Gemma 3: each head of q and k normalised before RoPE
            norm = GemmaRMSNorm if args.gemma else RMSNorm
            self.q_norm, self.k_norm = norm(args.head_dim, args.norm_eps), norm(args.head_dim, args.norm_eps)
        self.qk_norm = args.qk_norm
        # Gemma scales scores by query_scale^-1/2: q scaled so that attention's head_dim^-1/2 gives it
        self.q_scale = (args.head_dim / args.query_scale) ** 0.5 if args.query_scale else None
        self.projection = each_layer  # (x, layers) -> their outputs; replaceable (linears.use_projection)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, keep=None, segments=None):
        """(B, T, dim), or (N, dim) at the flat positions keep (N,) of (B, T) (every position still attends).
        segments (B, T): packed rows, attending within their own example (with mask None)."""
        B, T, _ = x.shape
        q, k, v = self.projection(x, (self.q_proj, self.k_proj, self.v_proj))
        q, k = q.view(B, T, self.n_heads, self.head_dim), k.view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = k.transpose(1, 2)  # (B, n_kv, T, head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rope = (cos, sin)  # attend rotates q and k (in its packed rows' C loop, on the way in)
        scaled = self.q_scale is not None and self.q_scale != 1.0
        if cache is not None or scaled:  # these need q and k rotated here
            q, k, rope = apply_rope(q, cos, sin), apply_rope(k, cos, sin), None
        if scaled:
            q = q * self.q_scale
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, n_kv, pos + T, head_dim)
        # mask None with T == 1: one query sees every key
        y = attend(q, k, v, mask, causal=mask is None and T > 1, segments=segments if T > 1 else None, rope=rope)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_heads * head_dim)
        return run_linear(self.o_proj, kept(y, keep))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        inner = intermediate_size or args.intermediate_size
        self.gate_proj = nn.Linear(args.dim, inner, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.dim, inner, bias=args.mlp_bias)
        self.down_proj = nn.Linear(inner, args.dim, bias=args.mlp_bias)
        self.projection = each_layer
        self.gelu = args.hidden_act == "gelu_pytorch_tanh"  # Gemma's GeGLU

    def forward(self, x, lean: bool = False):
        g, u = self.projection(x, (self.gate_proj, self.up_proj))  # (B, T, intermediate)
        if self.gelu:
            return run_linear(self.down_proj, F.gelu(g, approximate="tanh") * u)
        h = swiglu(g, u)
        with recompute_when_saved(h, lambda: silu_mul(g, u), lean):  # g, u are saved by SwiGLU anyway
            return run_linear(self.down_proj, h)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        moe = args.moe
        if moe is not None and layer_idx in moe.sparse_layers:
            shared = FeedForward(args, moe.shared_expert_dim) if moe.shared_expert_dim else None
            self.mlp = SparseMoE(args, shared)
        else:
            self.mlp = FeedForward(args)

    def forward(self, x, cos, sin, mask, cache=None, lean: bool = False, keep=None, segments=None):
        """lean: keep the norms' outputs and the SwiGLU product as recipes for backward (training).
        keep (N,) flat positions of (B, T): return only those, (N, dim); the others still serve as keys and values."""
        h = self.input_layernorm(x)
        with recompute_when_saved(h, lambda x=x: self.input_layernorm(x), lean):  # x is saved by the norm anyway
            x = kept(x, keep) + self.self_attn(h, cos, sin, mask, cache, keep, segments)
        h = self.post_attention_layernorm(x)
        with recompute_when_saved(h, lambda x=x: self.post_attention_layernorm(x), lean):
            return x + self.mlp(h, lean)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(
            SandwichBlock(Attention(args, i), FeedForward(args), args.dim, args.norm_eps)
            if args.gemma
            else Block(args, i)
            for i in range(args.n_layers)
        )
        self.norm = (GemmaRMSNorm if args.gemma else RMSNorm)(args.dim, args.norm_eps)


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.gradient_checkpointing = False  # True / "block", or "selective" (attention's outputs kept)
        self.offload_activations = False  # CUDA: saved activations in pinned host memory until backward
        self._rope: dict = {}  # device -> inv_freq, built once per device
        self._compiled_blocks: list | None = None  # set by compile_blocks
        self.router_logits: list = []  # a mixture's router logits of the last forward, per sparse layer
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.record = self.router_logits
        # where the weights came from (set by load_model): adapters record `source` as their base,
        # a merge of quantised layers re-reads the original weights from `folder`
        self.source: str | None = None
        self.folder: Path | None = None
        if args.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self):
        self.lm_head.weight = self.model.embed_tokens.weight

    def untie_weights(self):
        """Give lm_head a weight of its own (a copy), so that changing it leaves the embedding as it is."""
        if self.args.tie_word_embeddings:
            w = self.lm_head.weight
            self.lm_head.weight = nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
            self.args.tie_word_embeddings = False

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, local: bool = False):
        """cos/sin (B, 1, T, head_dim) for integer positions (B, T); angles in float32 as HF does. local: Gemma's
        sliding layers' own base."""
        key = positions.device, local
        if key not in self._rope:
            args = replace(self.args, rope_theta=self.args.local_rope_theta, rope_scaling=None) if local else self.args
            self._rope[key] = rope_inv_freq(args).to(positions.device)
        freqs = positions[..., None].float() * self._rope[key]  # (B, T, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def hidden(self, input_ids, position_ids=None, segment_ids=None, cache: KVCache | None = None, keep=None):
        """Final normed hidden states (B, T, dim), or (N, dim) at the positions where keep (B, T) is True (or at
        the flat positions keep (N,) of (B, T): no host sync on a GPU when they were computed before the batch moved).

        position_ids (B, T): defaults to 0..T-1 (after the cache's stored positions).
        segment_ids (B, T): for packed rows; tokens attend only within their segment.
        """
        B, T = input_ids.shape
        self.router_logits.clear()
        start = cache.pos if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        if keep is not None and keep.dtype == torch.bool:
            keep = keep.flatten().nonzero().squeeze(1)  # flat positions: a compiled block sees no data-dependent shape
        x = self.model.embed_tokens(input_ids)  # (B, T, dim)
        if self.args.gemma:  # Gemma scales the embeddings by sqrt(dim), rounded to their dtype
            x = x * torch.tensor(self.args.dim**0.5, dtype=x.dtype)
        views = {
            local: self._attention_inputs(position_ids, x.dtype, start, segment_ids, cache, local)
            for local in {False, *([True] if self.args.local_layers else [])}
        }
        last = len(self.model.layers) - 1
        # the load-balancing loss reads the router at every position, as transformers does
        routes_all = self.args.moe is not None and self.args.moe.output_router_logits and torch.is_grad_enabled()
        # training passes only: a cache's growing length would make every decoded token a new graph, and eval's
        # no-grad graphs would be compiled again beside the training ones
        compiled = self._compiled_blocks and cache is None and torch.is_grad_enabled()
        blocks = self._compiled_blocks if compiled else self.model.layers
        # compile errors of forward and backward surface here, where the compiled blocks fall back to eager
        with strict_compiling() if compiled else contextlib.nullcontext():
            for i, layer in enumerate(blocks):
                cos, sin, mask, segments = views[i in self.args.local_layers]  # Gemma: sliding or global layer
                # the last block's output projection and MLP run at the kept positions only (a loss's targets)
                rows = keep if i == last and not routes_all else None
                with offloaded(self.offload_activations and self.training, x.device):
                    if self.gradient_checkpointing and self.training:
                        selective = (
                            {"context_fn": _selective_contexts} if self.gradient_checkpointing == "selective" else {}
                        )
                        x = checkpoint(
                            layer, x, cos, sin, mask, keep=rows, segments=segments, use_reentrant=False, **selective
                        )
                    else:
                        x = layer(
                            x,
                            cos,
                            sin,
                            mask,
                            cache,
                            lean=self.training and torch.is_grad_enabled(),
                            keep=rows,
                            segments=segments,
                        )
        if cache is not None:
            cache.advance(T)
        return self.model.norm(kept(x, keep) if routes_all else x)

    def _attention_inputs(self, position_ids, dtype, start: int, segment_ids, cache, local: bool) -> tuple:
        """(cos, sin, mask, segments) for the global layers, or with local for Gemma's sliding layers (their own
        RoPE base and window); packed rows attend runs without a mask."""
        T = position_ids.shape[1]
        cos, sin = self.rope(position_ids, dtype, local)
        window = self.args.local_window if local else self.args.sliding_window
        if isinstance(cache, StaticKVCache) and T == 1:
            mask = cache.step_mask(window)
        else:
            key_mask = None if cache is None else cache.key_mask
            mask = attention_mask(T, start, position_ids.device, segment_ids, key_mask, window)
        return cos, sin, mask, segment_ids if mask is None else None

    def compile_blocks(self, **options) -> None:
        """Run each decoder block through torch.compile(**options) in training passes (with gradients, no KV cache):
        one graph per block with its elementwise work fused and its backward written by inductor; every block
        shares the graphs of the first (parameters are graph inputs). Where compiling fails, a warning and eager
        blocks."""
        self._compiled_blocks = [compiled(layer, "decoder blocks run eager", **options) for layer in self.model.layers]

    def forward(
        self,
        input_ids,
        position_ids=None,
        segment_ids=None,
        cache: KVCache | None = None,
        keep=None,
        hidden_only: bool = False,
    ):
        """Logits (B, T, vocab); with hidden_only, `hidden`'s states for a target-only loss (through
        forward, so that hooks on the whole model, as FSDP's, see the call)."""
        h = self.hidden(input_ids, position_ids, segment_ids, cache, keep)
        return h if hidden_only else run_linear(self.lm_head, h)

    def new_cache(
        self, batch: int, max_len: int, key_mask: torch.Tensor | None = None, static: bool = False
    ) -> KVCache:
        """static: a StaticKVCache (key_mask required) for decoding steps of one shape."""
        p = self.model.embed_tokens.weight
        return (StaticKVCache if static else KVCache)(self.args, batch, max_len, p.device, p.dtype, key_mask)
