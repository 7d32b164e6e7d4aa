"""How the next token is picked: greedy at temperature 0, else drawn from logits / temperature, cut to the top_k
tokens and the top_p nucleus, by inverse transform sampling with a uniform of the row's own. A row's uniforms
come from a CPU generator seeded for that row, drawn up front: its tokens depend on its prompt, its seed and the
weights, not on which rows share its batch, on which rank it runs or on a resume."""

from __future__ import annotations

import torch


def filtered_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """float32 logits / temperature, -inf outside the top_k and outside the top_p nucleus."""
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def pick(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, u: torch.Tensor | None
) -> torch.Tensor:
    """The next token of each row (B,) from logits (B, V): greedy at temperature 0, else by the row's uniform u
    (B,) float64."""
    if temperature <= 0:
        return logits.argmax(-1)
    cdf = filtered_logits(logits, temperature, top_k, top_p).softmax(-1).cumsum(-1)  # (B, V)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1].double()).to(cdf.dtype)[:, None]).squeeze(-1)
    return picked.clamp(max=cdf.shape[-1] - 1)


def row_uniforms(seeds: list[int], n: int, device) -> torch.Tensor:
    """(rows, n) float64: each row's first n uniforms from a CPU generator seeded with its seed, the numbers it
    would draw one at a time."""
    return torch.stack(
        [torch.rand(n, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
    ).to(device)
