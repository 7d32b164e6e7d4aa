"""Low-rank adapters on the native LLaMA's linear layers.

    x ──► W0 (frozen, out×in) ──────────────┐
    │                                       (+) ──► y = W0·x + (alpha/r)·B·A·x
    └──► A (r×in) ──► B (out×r) ──► ·scale ─┘

A starts Kaiming-uniform (as nn.Linear), B starts at zero, so training begins at
exactly the base model. `scale` is alpha/r, or alpha/sqrt(r) with rslora. The
base layer may be an nn.Linear or a bitsandbytes 8-bit/4-bit linear: forward only
calls it, never reads its weight.

Module and parameter names follow PEFT (`q_proj.base_layer`, `q_proj.lora_A`,
`q_proj.lora_B`), so adapter keys are PEFT's with the `base_model.model.` prefix.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .config import LoraSettings
from .errors import UserError

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

    def _fused(self, x: torch.Tensor) -> bool:
        """One autograd node for the whole layer: plain frozen float base, no dropout, one dtype."""
        base = self.base_layer
        return (type(base) is nn.Linear and not torch.is_autocast_enabled(x.device.type) and type(self.lora_dropout) is nn.Identity
                and not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
                and x.dtype == base.weight.dtype == self.lora_A.weight.dtype == self.lora_B.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base_layer(x)
        x2 = x.reshape(-1, self.in_features)  # (N, in): 2-D so the update below is not on a view
        if self._fused(x2):
            y = _LoRALinearFn.apply(x2, self.base_layer.weight, self.base_layer.bias,
                                    self.lora_A.weight, self.lora_B.weight, self.scale)
            return y.view(*x.shape[:-1], self.out_features)
        y = self.base_layer(x2)  # (N, out)
        a = self.lora_A(self.lora_dropout(x2).to(self.lora_A.weight.dtype))  # (N, r)
        if type(self.base_layer) is nn.Linear and y.dtype == a.dtype == self.lora_B.weight.dtype:  # not under autocast
            # y += scale·a·Bᵀ in place: no full-width temporaries for B·a, its scaling and the sum
            # (safe for autograd: a linear's backward never reads its own output)
            y.addmm_(a, self.lora_B.weight.t(), alpha=self.scale)
        else:
            y = y + (self.lora_B(a) * self.scale).to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

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


class _LoRALinearFn(torch.autograd.Function):
    """y = x·W0ᵀ + b + scale·(x·Aᵀ)·Bᵀ for a frozen W0, saving only x and a = x·Aᵀ.

    Backward does no work for W0 and writes both paths of the input gradient into one
    buffer (gy·W0, then += scale·(gy·B)·A in place), where autograd would allocate a
    full-width gradient per path and add them.
    """

    @staticmethod
    def forward(ctx, x, w0, bias, lora_a, lora_b, scale):
        y = torch.nn.functional.linear(x, w0, bias)  # (N, out)
        a = x @ lora_a.t()  # (N, r)
        y.addmm_(a, lora_b.t(), alpha=scale)
        ctx.save_for_backward(x, a, w0, lora_a, lora_b)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, gy):
        x, a, w0, lora_a, lora_b = ctx.saved_tensors
        need_x, _, _, need_a, need_b, _ = ctx.needs_input_grad
        ga = (gy @ lora_b).mul_(ctx.scale)  # (N, r): the gradient reaching a
        grad_a = ga.t() @ x if need_a else None  # (r, in)
        grad_b = (gy.t() @ a).mul_(ctx.scale) if need_b else None  # (out, r)
        grad_x = (gy @ w0).addmm_(ga, lora_a) if need_x else None  # (N, in)
        return grad_x, None, None, grad_a, grad_b, None


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
