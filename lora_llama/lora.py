"""Low-rank adapters on the native LLaMA's linear layers.

    x ──► W0 (frozen, out×in) ──────────────┐
    │                                       (+) ──► y = W0·x + (alpha/r)·B·A·x
    └──► A (r×in) ──► B (out×r) ──► ·scale ─┘

A starts Kaiming-uniform (as nn.Linear), B starts at zero, so training begins at
exactly the base model. `scale` is alpha/r, or alpha/sqrt(r) with rslora. The
base layer may be an nn.Linear or a bitsandbytes 8-bit/4-bit linear: forward only
calls it, never reads its weight.

On the common path (plain frozen base, no dropout) a layer, or layers sharing an input
(q, k, v; gate, up: `project`), run as one autograd node with a hand-written backward.

Module and parameter names follow PEFT (`q_proj.base_layer`, `q_proj.lora_A`,
`q_proj.lora_B`), so adapter keys are PEFT's with the `base_model.model.` prefix.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import LoraSettings
from .errors import UserError
from .gemm import linear, run_linear

# short target name -> module path inside a decoder block (lm_head lives at the top)
TARGET_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj", "lm_head": "lm_head",
}
HF_NAME = {t: path.rsplit(".", 1)[-1] for t, path in TARGET_MODULES.items()}  # q -> q_proj


def init_lora_a(w: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # as nn.Linear: a bounded start for A


def init_lora_b(w: torch.Tensor) -> None:
    nn.init.zeros_(w)  # B = 0: the adapted model starts as the base model


class LoRALinear(nn.Module):
    """x ↦ W0·x + scale·B·A·dropout(x), with W0 frozen and only A, B trained."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0, rslora: bool = False):
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.scale = r, alpha / (math.sqrt(r) if rslora else r)
        w = base.weight
        device = w.device if w.device.type != "meta" else None
        # adapters stay in float32 under half-precision bases (as PEFT does) for stable updates
        dtype = w.dtype if w.dtype == torch.float32 else torch.float32
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        init_lora_a(self.lora_A.weight)
        init_lora_b(self.lora_B.weight)
        self.merged = False

    def fused(self, x: torch.Tensor) -> bool:
        """Whether the layer can run as one autograd node: plain frozen float base, no dropout, one dtype."""
        base = self.base_layer
        return (type(base) is nn.Linear and type(self.lora_dropout) is nn.Identity
                and not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
                and x.dtype == base.weight.dtype == self.lora_A.weight.dtype == self.lora_B.weight.dtype
                and not torch.is_autocast_enabled(x.device.type))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return run_linear(self.base_layer, x)
        x2 = x.reshape(-1, self.in_features)  # (N, in): 2-D so the update below is not on a view
        if self.fused(x2):
            (y,) = _SharedInputLoRA.apply(x2, (self.scale,), *self.fused_params())
            return y.view(*x.shape[:-1], self.out_features)
        y = run_linear(self.base_layer, x2)  # (N, out)
        a = self.lora_A(self.lora_dropout(x2).to(self.lora_A.weight.dtype))  # (N, r)
        if type(self.base_layer) is nn.Linear and y.dtype == a.dtype == self.lora_B.weight.dtype:  # not under autocast
            # y += scale·a·Bᵀ in place: no full-width temporaries for B·a, its scaling and the sum
            # (safe for autograd: a linear's backward never reads its own output)
            y.addmm_(a, self.lora_B.weight.t(), alpha=self.scale)
        else:
            y = y + (self.lora_B(a) * self.scale).to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def fused_params(self) -> tuple:
        return self.base_layer.weight, self.base_layer.bias, self.lora_A.weight, self.lora_B.weight

    def delta_weight(self) -> torch.Tensor:
        """ΔW = scale·B·A (out, in) in float32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scale

    def _float_base_weight(self) -> torch.Tensor:
        w = self.base_layer.weight
        if not isinstance(self.base_layer, nn.Linear) or not w.is_floating_point():
            raise UserError("cannot merge into quantised base weights (lossy); use `lora-llama merge` or merge_lora, "
                            "which fold ΔW into the original full-precision weights")
        return w

    @torch.no_grad()
    def merge(self) -> None:
        """Fold ΔW into W0 in place (float32 arithmetic, cast back); forward becomes the base forward."""
        if not self.merged:
            w = self._float_base_weight()
            w.copy_((w.float() + self.delta_weight()).to(w.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            w = self._float_base_weight()
            w.copy_((w.float() - self.delta_weight()).to(w.dtype))
            self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, scale={self.scale:g}"


class _SharedInputLoRA(torch.autograd.Function):
    """y_i = x·W_iᵀ + b_i + s_i·(x·A_iᵀ)·B_iᵀ with W_i frozen, for layers reading one x; params: (W_i, b_i, A_i, B_i)*.

    Forward reads x once for all A (stacked) and saves only x and a = x·[A_1; A_2; ...]ᵀ.
    Backward does no work for the W_i and writes the whole input gradient into one buffer
    (Σ gy_i·W_i, then += ga·[A_i]), where autograd allocates one per path and adds them.
    """

    @staticmethod
    def forward(ctx, x, scales, *params):
        layers = [params[i:i + 4] for i in range(0, len(params), 4)]
        lora_a = torch.cat([p[2] for p in layers]) if len(layers) > 1 else layers[0][2]  # (Σr, in)
        a = linear(x, lora_a)  # (N, Σr)
        ends = list(itertools.accumulate(p[3].shape[1] for p in layers))
        ctx.cols = [slice(e - p[3].shape[1], e) for e, p in zip(ends, layers)]  # layer i's columns of a
        ys = [linear(x, w0, bias).addmm_(a[:, cols], lora_b.t(), alpha=scale)  # (N, out_i)
              for (w0, bias, _, lora_b), cols, scale in zip(layers, ctx.cols, scales)]
        ctx.save_for_backward(x, a, lora_a, *params)
        ctx.scales = scales
        ctx.set_materialize_grads(False)  # an output outside the loss gets None, not a zero-filled gradient
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads_y):
        x, a, lora_a, *params = ctx.saved_tensors
        need = ctx.needs_input_grad[2:]  # per params entry
        grads, grad_x = [None] * len(params), None
        ga = torch.zeros_like(a)  # gradient reaching a, (N, Σr)
        for i, (gy, cols, scale) in enumerate(zip(grads_y, ctx.cols, ctx.scales)):
            if gy is None:
                continue
            ga[:, cols] = linear(gy, params[4 * i + 3].t()).mul_(scale)
            if need[4 * i + 3]:
                # B_i: (out_i, r) = gyᵀ·a, as (aᵀ·gy)ᵀ: a product over the N rows goes to oneDNN as small·(big view)ᵀ
                grads[4 * i + 3] = linear(a[:, cols].t().contiguous(), gy.t()).t().mul_(scale)
            if ctx.needs_input_grad[0]:
                gx = linear(gy, params[4 * i].t())  # gy·W_i
                grad_x = gx if grad_x is None else grad_x.add_(gx)
        reached = [gy is not None and need[4 * i + 2] for i, gy in enumerate(grads_y)]
        if any(reached):
            grad_lora_a = linear(ga.t().contiguous(), x.t())  # (Σr, in) = gaᵀ·x: one product for all A
            for i, cols in enumerate(ctx.cols):
                grads[4 * i + 2] = grad_lora_a[cols] if reached[i] else None  # as autograd: None, not zeros
        if grad_x is not None:
            grad_x.addmm_(ga, lora_a)
        return (grad_x, None, *grads)


def project(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """The outputs of linear layers that read the same x (q, k, v; gate, up).

    LoRA layers on the plain path (see LoRALinear.fused) run as one autograd node; anything
    else (plain or quantised layers, dropout, autocast) runs layer by layer.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if len(layers) > 1 and all(isinstance(m, LoRALinear) and not m.merged and m.fused(x2) for m in layers):
        ys = _SharedInputLoRA.apply(x2, tuple(m.scale for m in layers), *[t for m in layers for t in m.fused_params()])
        return [y.view(*x.shape[:-1], y.shape[-1]) for y in ys]
    return [run_linear(m, x) for m in layers]


def target_paths(model, settings: LoraSettings) -> list[str]:
    """Dotted module paths that the settings adapt, e.g. `model.layers.0.self_attn.q_proj`."""
    n_layers = model.args.n_layers
    layers = range(n_layers) if settings.layers is None else settings.layers
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise UserError(f"LoRA layer {bad[0]} does not exist (the model has layers 0..{n_layers - 1})")
    paths = [f"model.layers.{i}.{TARGET_MODULES[t]}" for i in layers for t in settings.targets if t != "lm_head"]
    return paths + (["lm_head"] if "lm_head" in settings.targets else [])


def lora_modules(model) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model, settings: LoraSettings) -> dict:
    """Wrap the targeted linears in LoRALinear, freeze everything else; return a parameter summary."""
    if lora_modules(model):
        raise UserError("the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    if "lm_head" in settings.targets and model.args.tie_word_embeddings:
        # give lm_head its own weight, so that merging its adapter never changes the embedding
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
        model.args.tie_word_embeddings = False
    for path in target_paths(model, settings):
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, LoRALinear(getattr(parent, child), settings.r, settings.alpha, settings.dropout,
                                          settings.rslora))
    model.lora_settings = settings
    return parameter_summary(model)


def parameter_summary(model) -> dict:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": trainable, "total": total, "percent": round(100 * trainable / total, 4)}


def lora_state_dict(model) -> dict[str, torch.Tensor]:
    """Native names of the adapter tensors, e.g. `model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def merge_lora(model) -> None:
    """Fold every adapter into its base weight and unwrap it, leaving a plain Llama.

    A quantised base layer is never merged into: its ORIGINAL full-precision weight is
    read again from the checkpoint, ΔW added, and a plain nn.Linear takes its place.
    """
    from .checkpoint import read_tensors

    modules = lora_modules(model)
    quantized = [p for p, m in modules.items() if not m.base_layer.weight.is_floating_point()]
    originals = read_tensors(model.folder, [f"{p}.weight" for p in quantized]) if quantized else {}
    dtype = model.model.embed_tokens.weight.dtype
    for path, m in modules.items():
        if path in quantized:
            base = m.base_layer
            merged = nn.Linear(m.in_features, m.out_features, bias=base.bias is not None,
                               device=m.lora_A.weight.device, dtype=dtype)
            with torch.no_grad():
                w0 = originals[f"{path}.weight"].to(merged.weight.device)
                merged.weight.copy_((w0.float() + m.delta_weight()).to(dtype))
                if base.bias is not None:
                    merged.bias.copy_(base.bias)
            merged.requires_grad_(False)
        else:
            m.merge()
            merged = m.base_layer
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, merged)
    model.lora_settings = None
