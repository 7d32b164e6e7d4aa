"""Low-rank adapters on the native LLaMA's linear layers.

    x ──► W0 (frozen, out×in) ──────────────┐
    │                                       (+) ──► y = W0·x + (alpha/r)·B·A·x
    └──► A (r×in) ──► B (out×r) ──► ·scale ─┘

A starts Kaiming-uniform (as nn.Linear), B starts at zero, so training begins at
exactly the base model. `scale` is alpha/r, or alpha/sqrt(r) with rslora. The
base layer may be an nn.Linear or a frozen 8-bit / 4-bit `QuantizedLinear`. Merging
folds ΔW = scale·B·A into W0 (`fold`).

DoRA (`use_dora`) adds a trained magnitude m per output row: W' = m · (W0 + scale·B·A) / ‖W0 + scale·B·A‖,
the norm taken per row and detached from the gradient (as peft does). The norm comes from r x r and
out x r products (`row_norms`), never from the (out, in) sum, and W0's own row norms are kept from the start.

On the common path (a frozen base, plain or quantized, and no dropout) a layer offers its products as one
fused autograd node (`low_rank_node`, run by kernels/low_rank.py), alone or, through `shared_input_projection`
(the model's projection once adapters are applied), with the layers that share its input (q, k, v; gate, up).
Elsewhere (compiled, without gradients, with dropout) the same W0·x + b + scale·B·A·x is written once, as plain
products (`LoRALinear._plain`).

The model-wide operations (`apply_lora`, merge, adapters switched off, the state dict) are in `adapted.py`.
Module and parameter names follow PEFT (`q_proj.base_layer`, `q_proj.lora_A`,
`q_proj.lora_B`), so adapter keys are PEFT's with the `base_model.model.` prefix.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lora_llama.errors import UserError
from lora_llama.kernels.low_rank import low_rank_linears
from lora_llama.lora.init import init_adapter, moves_w0, principal_init
from lora_llama.lora.settings import lora_scale
from lora_llama.model.linears import each_layer, run_linear
from lora_llama.quant.linear import QuantizedLinear


def fold(
    w0: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    inplace: bool = False,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """W0 + scale·B·A in float32, the one place a merge computes it (negative scale: unmerge); with a DoRA
    magnitude, each row then scaled to it: m · (W0 + scale·B·A) / ‖W0 + scale·B·A‖.

    inplace: a float32 w0 that the caller owns (a fresh copy read from a shard) is updated
    in place, so no (out, in) temporary is made besides it.
    """
    w = w0.float()
    if w is w0 and not inplace:  # .float() of a float32 tensor is the tensor itself
        w = w.clone()
    w = w.addmm_(lora_b.to(w.device, torch.float32), lora_a.to(w.device, torch.float32), alpha=scale)
    if magnitude is not None:
        w.mul_((magnitude.to(w.device, torch.float32) / w.norm(dim=1))[:, None])
    return w


def row_norms(
    w0: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, w0_squared: torch.Tensor
) -> torch.Tensor:
    """‖W0 + scale·B·A‖ per row (float32) without the (out, in) sum: ‖W0_i‖² (given) + 2·scale·B_i·(W0·Aᵀ)_i
    + scale²·B_i·(A·Aᵀ)·B_iᵀ. W0·Aᵀ is one (out, in) x (in, r) product in W0's dtype."""
    a, b = lora_a.float(), lora_b.float()
    cross = F.linear(lora_a.to(w0.dtype), w0).float().t()  # (out, r)
    squared = w0_squared + 2 * scale * (cross * b).sum(1) + scale * scale * ((b @ (a @ a.t())) * b).sum(1)
    return squared.clamp_min(0).sqrt()


def dense_weight(base: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A base layer's weight as a float matrix: a quantized one dequantized (what its products use)."""
    return base.dequantize(dtype) if type(base) is QuantizedLinear else base.weight


class _MagnitudeScale(torch.autograd.Function):
    """DoRA's c·(W0·x + scale·B·A·x) with c = m / norm per output: keeps the sum alone (one (N, out) tensor) for
    m's gradient, where autograd would keep both terms."""

    @staticmethod
    def forward(ctx, w0x, low_rank, magnitude, norms):
        z = w0x.float() + low_rank
        c = magnitude.float() / norms
        ctx.save_for_backward(z, c, norms)
        ctx.dtypes = (w0x.dtype, low_rank.dtype, magnitude.dtype)
        return z * c

    @staticmethod
    def backward(ctx, grad):
        z, c, norms = ctx.saved_tensors
        g = grad.float()
        grad_z = g * c
        grad_m = (g * z).sum(0) / norms
        return grad_z.to(ctx.dtypes[0]), grad_z.to(ctx.dtypes[1]), grad_m.to(ctx.dtypes[2]), None


class LoRALinear(nn.Module):
    """x ↦ W0·x + scale·B·A·dropout(x), with W0 frozen and only A, B trained."""

    def __init__(
        self,
        base: nn.Module,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        rslora: bool = False,
        use_dora: bool = False,
        init=True,
    ):
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.dropout, self.rslora, self.use_dora = r, alpha, dropout, rslora, use_dora
        self.scale = lora_scale(r, alpha, rslora)
        w = base.weight
        device = w.device if w.device.type != "meta" else None
        # adapters stay in float32 under half-precision bases (as PEFT does) for stable updates
        dtype = w.dtype if w.dtype == torch.float32 else torch.float32
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.init = init
        if moves_w0(init):
            take_principal_part(self, init)
        else:
            init_adapter(self.lora_A, self.lora_B, init)
        if use_dora:  # m starts at W0's row norms (B = 0): the adapted model starts as the base model
            with torch.no_grad():
                squared = dense_weight(base, torch.float32).float().square().sum(1)
            self.register_buffer("w0_squared", squared, persistent=False)
            self.lora_magnitude_vector = nn.Parameter(squared.sqrt().to(dtype))
        self.merged = False  # ΔW folded into the base weight
        self.disabled = False  # the base output only (see `adapters_disabled`)

    def fused(self, x: torch.Tensor, dropout_off: bool = False) -> bool:
        """Whether the layer can run as one autograd node: a frozen base (plain in x's dtype, or quantized and
        dequantized into it), no dropout (or, with dropout_off, one switched off by eval mode), A and B in x's dtype
        or in float32 (bf16-mixed: float32 masters, cast for the products)."""
        base = self.base_layer
        plain = type(base) is nn.Linear and not base.weight.requires_grad and x.dtype == base.weight.dtype
        return (
            (plain or type(base) is QuantizedLinear)
            and (type(self.lora_dropout) is nn.Identity or (dropout_off and not self.lora_dropout.training))
            and (base.bias is None or (not base.bias.requires_grad and base.bias.dtype == x.dtype))
            and x.is_floating_point()
            and self.lora_A.weight.dtype == self.lora_B.weight.dtype
            and self.lora_A.weight.dtype in (x.dtype, torch.float32)
            and not torch.is_autocast_enabled(x.device.type)
        )

    def low_rank_node(self, x: torch.Tensor) -> tuple | None:
        """(W0, b, A, B, scale) for kernels' fused node, or None when this layer must run on its own."""
        base = self.base_layer
        if self.merged or self.disabled or self.use_dora or not self.fused(x):
            return None
        if type(base) is QuantizedLinear and base.runs_integer_products(x):
            return None  # its product is int8 x int8, its own
        w0 = base.transient_weight if type(base) is QuantizedLinear else base.weight  # dequantized inside the node
        return w0, base.bias, self.lora_A.weight, self.lora_B.weight, self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged or self.disabled:
            return run_linear(self.base_layer, x)
        x2 = x.reshape(-1, self.in_features)  # (N, in): 2-D so the update below is not on a view
        if self.use_dora:
            return self._dora(x2).view(*x.shape[:-1], self.out_features)
        node = self.low_rank_node(x2) if torch.is_grad_enabled() and not torch.compiler.is_compiling() else None
        if node is not None:
            (y,) = low_rank_linears(x2, [node])
        else:
            y = self._plain(x2, self.fused(x2, dropout_off=not torch.is_grad_enabled()))
        return y.view(*x.shape[:-1], self.out_features)

    def _plain(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """W0·x + b + scale·B·A·dropout(x) as plain products, where the node does not run: compiled (inductor
        writes the backward and fuses the casts), without gradients (a decoding step's few rows: oneDNN's per-call
        cost made the node 1.3-2.3x the plain products of q, k and v), or a layer the node cannot take (dropout, a
        trained or other base, autocast). A fused layer computes in x's dtype (float32 masters cast), the others in
        the adapter's; the update is added in place where the dtypes agree (no full-width temporaries for B·A·x,
        its scaling and the sum; a linear's backward never reads its own output)."""
        y = run_linear(self.base_layer, x)  # (N, out)
        dtype = x.dtype if fused else self.lora_A.weight.dtype
        a = F.linear(self.lora_dropout(x).to(dtype), self.lora_A.weight.to(dtype))  # (N, r)
        lora_b = self.lora_B.weight.to(dtype)
        if y.dtype == dtype and (fused or type(self.base_layer) in (nn.Linear, QuantizedLinear)):
            return y.addmm_(a, lora_b.t(), alpha=self.scale)
        return y + (F.linear(a, lora_b) * self.scale).to(y.dtype)

    def _dora(self, x: torch.Tensor) -> torch.Tensor:
        """W0·x + b + (c - 1)·W0·x' + c·scale·B·A·x' with c = m / ‖W0 + scale·B·A‖ (detached) and x' = dropout(x):
        peft's DoRA, the base product reused when there is no dropout."""
        base = self.base_layer
        y = run_linear(base, x)  # (N, out)
        dropped = self.lora_dropout(x)
        low_rank = self.lora_B(self.lora_A(dropped.to(self.lora_A.weight.dtype))).float() * self.scale
        with torch.no_grad():
            norms = row_norms(
                dense_weight(base, y.dtype), self.lora_A.weight, self.lora_B.weight, self.scale, self.w0_squared
            )
        if dropped is x:  # y = W0·x + b: the output is b + c·(W0·x + scale·B·A·x)
            w0x = y if base.bias is None else y - base.bias
            scaled = _MagnitudeScale.apply(w0x, low_rank, self.lora_magnitude_vector, norms).to(y.dtype)
            return scaled if base.bias is None else scaled + base.bias
        w0x = F.linear(dropped, dense_weight(base, y.dtype))  # y + (c - 1)·W0·x' + c·scale·B·A·x'
        return y - w0x + _MagnitudeScale.apply(w0x, low_rank, self.lora_magnitude_vector, norms).to(y.dtype)

    def _float_base_weight(self) -> torch.Tensor:
        w = self.base_layer.weight
        if not isinstance(self.base_layer, nn.Linear) or not w.is_floating_point():
            raise UserError(
                "cannot merge into quantised base weights (lossy); use `lora-llama merge` or merge_lora, "
                "which fold ΔW into the original full-precision weights"
            )
        return w

    @torch.no_grad()
    def merge(self) -> None:
        """Fold ΔW into W0 in place (float32 arithmetic, cast back); forward becomes the base forward. DoRA keeps
        each row's factor m / ‖W0 + scale·B·A‖ to undo it."""
        if not self.merged:
            w = self._float_base_weight()
            merged = fold(w, self.lora_A.weight, self.lora_B.weight, self.scale)
            if self.use_dora:
                self.row_factor = self.lora_magnitude_vector.float() / merged.norm(dim=1)
                merged.mul_(self.row_factor[:, None])
            w.copy_(merged)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            w = self._float_base_weight()
            unscaled = w.float() / self.row_factor[:, None] if self.use_dora else w
            w.copy_(fold(unscaled, self.lora_A.weight, self.lora_B.weight, -self.scale))
            self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, scale={self.scale:g}" + (", dora" if self.use_dora else "")


def shared_input_projection(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """The outputs of linear layers that read the same x (q, k, v; gate, up), the model's projection once adapters
    are applied: when every layer offers its low-rank node (`LoRALinear.low_rank_node`), one autograd node for all;
    otherwise (plain or quantized layers, dropout, autocast, compiled, no gradients) each layer on its own."""
    x2 = x.reshape(-1, x.shape[-1])
    fusable = len(layers) > 1 and not torch.compiler.is_compiling() and torch.is_grad_enabled()
    nodes = [m.low_rank_node(x2) if isinstance(m, LoRALinear) else None for m in layers] if fusable else [None]
    if all(n is not None for n in nodes):
        return [y.view(*x.shape[:-1], y.shape[-1]) for y in low_rank_linears(x2, nodes)]
    return each_layer(x, layers)


@torch.no_grad()
def take_principal_part(layer, how: str) -> None:
    """PiSSA / OLoRA on a `LoRALinear`: A, B from W0's principal part, the residual left as the frozen base; A0, B0
    kept for the plain form of the saved adapter."""
    base = layer.base_layer
    if type(base) is not nn.Linear or not base.weight.is_floating_point():
        raise UserError(
            f"init_lora_weights {how} needs the base's float weights (a quantized base is quantized "
            "after the residual is computed: lora-llama train does that)"
        )
    a, b, residual = principal_init(base.weight, layer.r, layer.scale, how)
    layer.lora_A.weight.copy_(a)
    layer.lora_B.weight.copy_(b)
    base.weight.copy_(residual.to(base.weight.dtype))
    layer.register_buffer("lora_A0", a.to(layer.lora_A.weight.dtype), persistent=False)
    layer.register_buffer("lora_B0", b.to(layer.lora_B.weight.dtype), persistent=False)
