"""Sampling with the KV cache: greedy, temperature, top-k, top-p; stops at EOS."""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> torch.Tensor:
    """Pick the next token id from logits (B, vocab); temperature 0 means greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = filtered_logits(logits, temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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


@torch.inference_mode()
def generate(
    model,
    prompt_ids: Iterable[int],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_ids: Iterable[int] = (),
    use_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Continue one prompt; returns the new token ids (EOS included when it ends the text)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], device=device)  # (1, T)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    eos = set(eos_ids)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    cache = model.new_cache(1, ids.shape[1] + max_new_tokens) if use_cache else None
    out: list[int] = []
    step_input = ids
    for _ in range(max_new_tokens):
        logits = model(step_input, cache=cache)[:, -1]  # (1, vocab)
        nxt = sample_next(logits, temperature, top_k, top_p, gen)
        token = int(nxt)
        out.append(token)
        if on_token:
            on_token(token)
        if token in eos:
            break
        step_input = nxt[:, None] if use_cache else torch.cat([step_input, nxt[:, None]], dim=1)
    return out
