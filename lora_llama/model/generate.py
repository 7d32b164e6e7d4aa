"""Sampling with the KV cache: greedy, temperature, top-k, top-p; stops at EOS."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from lora_llama.model.decoding import decoder_for

READ_EVERY = 8  # static decoding: tokens decoded between reads to the host (a read waits for the device)


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
    static: bool | None = None,
) -> list[int]:
    """Continue one prompt; returns the new token ids (EOS included when it ends the text). static: decode over a
    cache of fixed shape, on CUDA a replayed graph (decoding.py), reading the tokens to the host every READ_EVERY
    steps (None: on CUDA with the cache). on_token sees every token, in order, as it is read."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], device=device)  # (1, T)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    static = use_cache and device.type == "cuda" if static is None else static
    if static and not use_cache:
        raise ValueError("static decoding needs the KV cache (use_cache=True)")
    eos = set(eos_ids)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    steps = _static_steps(model, ids, max_new_tokens) if static else _steps(model, ids, max_new_tokens, use_cache)
    read_every = READ_EVERY if static else 1
    out: list[int] = []
    pending: list[torch.Tensor] = []  # tokens on the device, not yet read
    logits = next(steps)
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, gen)  # (1,), on the device
        pending.append(token)
        if len(pending) == read_every or step == max_new_tokens - 1:
            for read in torch.cat(pending).tolist():
                out.append(read)
                if on_token:
                    on_token(read)
                if read in eos:
                    return out
            pending = []
        if step < max_new_tokens - 1:
            logits = steps.send(token)
    return out


def _steps(model, ids: torch.Tensor, max_new_tokens: int, use_cache: bool):
    """Yields the last position's logits (1, V) of the prompt, then after each token sent (1,)."""
    cache = model.new_cache(1, ids.shape[1] + max_new_tokens) if use_cache else None
    step_input = ids
    while True:
        token = yield model(step_input, cache=cache)[:, -1]
        step_input = token[:, None] if use_cache else torch.cat([step_input, token[:, None]], dim=1)


def _static_steps(model, ids: torch.Tensor, max_new_tokens: int):
    """As _steps, the prompt through the model eagerly, then each token a step of the model's StaticDecoder."""
    width = ids.shape[1]
    prompt = model.new_cache(1, width, torch.ones(1, width, dtype=torch.bool, device=ids.device))
    logits = model(ids, cache=prompt)[:, -1]
    decoder = decoder_for(model, 1, width + max_new_tokens)
    decoder.load(prompt, 1, torch.full((1,), width, device=ids.device))
    while True:
        token = yield logits
        logits = decoder.step(token)
