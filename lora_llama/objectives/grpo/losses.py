"""GRPO's loss family as trl 1.16 defines it, per completion token on the flattened targets of a micro-batch: the
importance weights (per token, or per completion: GSPO), the per-token loss of each `loss_type` (the clipped
surrogate with two-sided clipping, CISPO's detached clipped weight, SAPO's soft gate, VESPO's gamma weight), the
entropy selection of top_entropy_quantile, the KL to the reference, and each loss type's reduction."""

from __future__ import annotations

import math

import torch

CLIP_STATS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def log_importance_weights(logps, old_logps, owner, n_rows: int, level: str) -> torch.Tensor:
    """log(π/πold) per completion token (N,): each token's own, or (sequence level, GSPO) the mean over its
    completion's tokens, given to each of them."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    sums = log_ratio.new_zeros(n_rows).index_add(0, owner, log_ratio)
    tokens = log_ratio.new_zeros(n_rows).index_add(0, owner, torch.ones_like(log_ratio))
    return (sums / tokens.clamp(min=1))[owner]


@torch.no_grad()
def gamma_weights(s, logps, old_logps, advantages, owner, n_rows: int) -> torch.Tensor:
    """VESPO's weight per token (N,), without gradient: φ(w) = exp(λ + k·log w - λ·w), w the completion's whole
    ratio (the exponential of the sum of its tokens' log-ratios), k and λ by the advantage's sign (s: train.grpo's
    settings); φ(1) = 1."""
    lowest = math.log(1e-8)
    log_ratio = torch.clamp(logps - old_logps, -20.0, 20.0)
    log_w = torch.clamp(log_ratio.new_zeros(n_rows).index_add(0, owner, log_ratio), lowest, 20.0)[owner]
    positive = advantages >= 0
    k = torch.where(positive, s.vespo_k_pos, s.vespo_k_neg)
    lam = torch.where(positive, s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def high_entropy(token_entropies: torch.Tensor, quantile: float) -> torch.Tensor:
    """The tokens (N,) whose entropy is at least the (1 - quantile)-quantile of all of them (trl's entropy mask)."""
    if token_entropies.numel() == 0:
        return torch.zeros_like(token_entropies, dtype=torch.bool)
    return token_entropies >= torch.quantile(token_entropies.float(), 1 - quantile)


def per_token_loss(
    s, logps, log_weights, advantages, ref_logps=None, vespo_weights=None, selected=None
) -> tuple[torch.Tensor, dict]:
    """trl's per-token loss of `s.loss_type` (+ beta·KL, times the ratio with use_bias_correction_kl) per completion
    token (N,), and the tokens whose ratio lies below, above and outside the clip region and the KL (trl's metrics),
    as sums over tokens. log_weights: log_importance_weights; vespo_weights: gamma_weights, for vespo; selected: the
    tokens that take the policy loss (top_entropy_quantile's), None for all."""
    low_eps, high_eps = s.epsilon, s.epsilon_high or s.epsilon
    ratio = torch.exp(log_weights)
    if s.loss_type == "cispo":  # the clipped ratio as a weight, no gradient through it
        loss = -torch.clamp(ratio, max=high_eps).detach() * advantages * logps
    elif s.loss_type == "vespo":
        loss = -vespo_weights * advantages * logps
    elif s.loss_type == "sapo":  # a soft gate: sigmoid(τ(r - 1))·4/τ, τ by the advantage's sign
        tau = torch.where(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
    else:
        clipped = torch.clamp(ratio, 1 - low_eps, 1 + high_eps)
        unclipped = torch.clamp(ratio, max=s.delta) if s.delta is not None else ratio
        loss = -torch.min(unclipped * advantages, clipped * advantages)
    if selected is not None:
        loss = loss * selected
    low = (ratio < 1 - low_eps) & (advantages < 0)
    high = (ratio > 1 + high_eps) & (advantages > 0)
    stats = dict(zip(CLIP_STATS, (float(low.sum()), float(high.sum()), float((low | high).sum()))))
    if s.beta:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        kl = kl * ratio if s.use_bias_correction_kl else kl  # the unbiased reverse-KL gradient (trl's default)
        loss = loss + s.beta * kl
        stats["kl"] = float(kl.detach().sum())
    return loss, stats


def reduce_loss(
    loss: torch.Tensor, rows: torch.Tensor, n_rows: int, loss_type: str, max_new_tokens: int
) -> torch.Tensor:
    """A micro-batch's loss term before the division by its global count (see GRPO.counts)."""
    if loss_type in ("grpo", "sapo"):  # per completion: the mean over its tokens
        per_row = loss.new_zeros(n_rows).index_add(0, rows, loss)
        tokens = loss.new_zeros(n_rows).index_add(0, rows, torch.ones_like(loss))
        return (per_row / tokens.clamp(min=1)).sum()
    if loss_type == "bnpo":
        return loss.sum() / max(loss.numel(), 1)
    if loss_type == "dr_grpo":
        return loss.sum() / max_new_tokens
    return loss.sum()  # dapo, cispo and vespo (by the global batch's tokens), luspo (by its completions)
