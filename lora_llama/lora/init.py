"""How an adapter starts (peft's `init_lora_weights`), and the plain form of one that moved part of W0 into A, B.

    true            A Kaiming-uniform (as nn.Linear), B = 0: the adapted model starts as the base model
    false           A and B both as nn.Linear initialises them (not the base model at the start; for tests)
    gaussian        A ~ N(0, 1/r), B = 0
    pissa           the r principal singular directions of W0: with W0 = U·S·Vᵀ, A = sqrt(S_r / scale)·V_rᵀ and
                    B = U_r·sqrt(S_r / scale); W0 - scale·B·A stays as the frozen base (the residual)
    pissa_niter_N   the same from torch.svd_lowrank with N subspace iterations (fast, approximate)
    olora           W0 = Q·R: B = Q_r, A = R_r, W0 - scale·B·A stays as the frozen base

PiSSA and OLoRA train on the residual base, so their adapter only fits it. `plain_adapter` turns one into a
plain LoRA adapter of rank 2r on the *original* base, as peft's `path_initial_model_for_weight_conversion` does:
W_res + s·B·A = W0 + s·[B, -B0]·[A; A0], with alpha doubled (x sqrt(2) with rsLoRA) so that the scale stays.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

PRINCIPAL = re.compile(r"pissa(_niter_(\d+))?|olora")


def check_init(value) -> None:
    if (
        value is True
        or value is False
        or value == "gaussian"
        or (isinstance(value, str) and PRINCIPAL.fullmatch(value))
    ):
        return
    raise ValueError(f"unknown init_lora_weights {value!r} (use true, false, gaussian, pissa, pissa_niter_N, olora)")


def moves_w0(value) -> bool:
    """Whether an initialisation moves part of W0 into the adapter (PiSSA, OLoRA)."""
    return isinstance(value, str) and PRINCIPAL.fullmatch(value) is not None


def init_adapter(lora_a: nn.Linear, lora_b: nn.Linear, how) -> None:
    """Initialise A and B in place for `true`, `false` or `gaussian` (see moves_w0 for the others)."""
    with torch.no_grad():
        if how is False:
            return
        if how == "gaussian":
            nn.init.normal_(lora_a.weight, std=1 / lora_a.weight.shape[0])
        else:
            nn.init.kaiming_uniform_(lora_a.weight, a=math.sqrt(5))  # as nn.Linear: a bounded start for A
        nn.init.zeros_(lora_b.weight)  # B = 0: the adapted model starts as the base model


@torch.no_grad()
def principal_init(weight: torch.Tensor, r: int, scale: float, how: str) -> tuple[torch.Tensor, ...]:
    """(A, B, residual W0 - scale·B·A) in float32 for pissa, pissa_niter_N and olora, as peft computes them."""
    w = weight.float()
    if how == "olora":
        q, rr = torch.linalg.qr(w)
        b, a = q[:, :r], rr[:r]
    else:
        niter = PRINCIPAL.fullmatch(how).group(2)
        if niter is None:
            u, s, vh = torch.linalg.svd(w, full_matrices=False)
            u, s, vh = u[:, :r], s[:r], vh[:r]
        else:
            u, s, v = torch.svd_lowrank(w, q=r, niter=int(niter))
            vh = v.t()
        root = (s / scale).sqrt()
        a, b = root[:, None] * vh, u * root[None]
    return a.contiguous(), b.contiguous(), w - scale * b @ a


def plain_adapter(tensors: dict, initial: dict, alpha: float, r: int, rslora: bool) -> tuple[dict, float, int]:
    """A PiSSA / OLoRA adapter's tensors (native names) and their starting values -> (tensors of the plain rank-2r
    adapter on the original base, its alpha, its r)."""
    out = dict(tensors)
    for key, start in initial.items():
        if ".lora_A." in key:
            out[key] = torch.cat([tensors[key], start.to(tensors[key].dtype)], dim=0)
        else:
            out[key] = torch.cat([tensors[key], -start.to(tensors[key].dtype)], dim=1)
    return out, alpha * (math.sqrt(2) if rslora else 2), 2 * r
