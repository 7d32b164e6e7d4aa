"""Batched sampling: many prompts, left-padded, continued together with the KV cache through the model as it
stands (adapters active: no merge, no copy, no second engine), for GRPO's rollouts and lm-eval's generations.

Each row draws its tokens from a generator of its own (a seed per row, on the CPU), by inverse transform
sampling: a row's completion depends on its prompt, its seed and the weights, not on which rows share its
batch, on which rank it runs or on a resume. Its uniforms are drawn up front and moved to the device once. On a
GPU the decoding steps run over a cache of fixed shape as a replayed CUDA graph (decoding.py), and whether every
row has stopped is asked every CHECK_EVERY tokens, not every token: the host never waits on the GPU mid-run."""

from __future__ import annotations

import torch

from lora_llama.model.decoding import decoder_for
from lora_llama.model.generate import filtered_logits

STOP_EVERY = 8  # tokens between stop-string checks (a decode of every row; a few extra tokens cost less)
CHECK_EVERY = 16  # tokens between a GPU's stop checks (a check waits for the device; a few extra steps cost less)


def _pick(logits: torch.Tensor, temperature: float, top_p: float | None, u: torch.Tensor | None) -> torch.Tensor:
    """The next token of each row (B,): greedy at temperature 0, else by the row's uniform u (B,) float64."""
    if temperature <= 0:
        return logits.argmax(-1)
    cdf = filtered_logits(logits, temperature, None, top_p).softmax(-1).cumsum(-1)  # (B, V)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1].double()).to(cdf.dtype)[:, None]).squeeze(-1)
    return picked.clamp(max=cdf.shape[-1] - 1)


def row_uniforms(seeds: list[int], n: int, device) -> torch.Tensor:
    """(rows, n) float64: each row's first n uniforms from a CPU generator seeded with its seed, the numbers it
    would draw one at a time."""
    return torch.stack(
        [torch.rand(n, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
    ).to(device)


def left_padded(prompts: list[list[int]], pad_id: int, extra: int, device) -> tuple[torch.Tensor, ...]:
    """(ids (B, P), position_ids (B, P), key_mask (B, P + extra)): prompts right-aligned, padding masked."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    key_mask = torch.ones((len(prompts), width + extra), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        key_mask[i, : width - len(p)] = False
    positions = (key_mask[:, :width].long().cumsum(1) - 1).clamp(min=0)
    return ids.to(device), positions.to(device), key_mask.to(device)


def sample_completions(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids,
    pad_id: int,
    temperature: float = 1.0,
    top_p: float | None = None,
    seeds: list[int] | None = None,
    group: int = 1,
    any_rank=None,
    static: bool | None = None,
    stopped=None,
) -> list[list[int]]:
    """Each prompt's completion (token ids, its first EOS included when it stops before max_new_tokens).
    seeds: one per row (temperature > 0). group: the rows come in runs of `group` equal prompts (GRPO's
    groups), and each prompt is run through the model once, its keys and values copied to its group.
    any_rank: under fsdp, whether any rank says yes; decoding goes on while any rank has rows to finish,
    since every forward gathers weights from all of them. static: decode over a StaticKVCache (decoding.py;
    None: on CUDA unless under fsdp, where the graph would capture its gathers). stopped: given the tokens so far
    (B, n), which rows are done besides an EOS (stop strings), asked every STOP_EVERY tokens; a done row's later
    tokens are padding."""
    static = next(model.parameters()).is_cuda and any_rank is None if static is None else static
    # fsdp's gathered weights must stay ordinary tensors for its later in-place updates: no_grad, not inference mode
    with torch.no_grad() if any_rank is not None else torch.inference_mode():
        return _sample(
            model, prompts, max_new_tokens, eos_ids, pad_id, temperature, top_p, seeds, group, any_rank, static, stopped
        )


def _sample(
    model, prompts, max_new_tokens, eos_ids, pad_id, temperature, top_p, seeds, group, any_rank, static, stopped
):
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    ids, positions, key_mask = left_padded(prompts[::group], pad_id, max_new_tokens, device)
    uniforms = row_uniforms(seeds, max_new_tokens, device) if temperature > 0 else None
    check_every = CHECK_EVERY if static else 1  # the growing cache's path (CPU, fsdp): a check costs less than a step
    was_training = model.training
    model.eval()
    try:
        cache = model.new_cache(ids.shape[0], key_mask.shape[1], key_mask)
        last = torch.zeros_like(ids, dtype=torch.bool)
        last[:, -1] = True
        logits = model(ids, position_ids=positions, cache=cache, keep=last)  # (B, V): only the last position
        next_pos = positions[:, -1].repeat_interleave(group, 0) + 1
        if static:
            decoder = decoder_for(model, len(prompts), key_mask.shape[1])
            decoder.load(cache, group, next_pos)

            def step_logits(token, step):
                return decoder.step(token)
        else:
            if group > 1:
                cache.repeat_rows(group)

            def step_logits(token, step):
                return model(token[:, None], position_ids=(next_pos + step)[:, None], cache=cache)[:, -1]

        logits = logits.repeat_interleave(group, 0)
        eos = torch.tensor(sorted(set(eos_ids)), device=device, dtype=torch.long)
        done = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)
        out = []
        for step in range(max_new_tokens):
            token = _pick(logits, temperature, top_p, None if uniforms is None else uniforms[:, step])
            token = token.masked_fill(done, pad_id)
            out.append(token)
            done |= torch.isin(token, eos)
            if stopped is not None and (step + 1) % STOP_EVERY == 0:
                done |= stopped(torch.stack(out, 1)).to(done.device)
            if step == max_new_tokens - 1:
                break
            if (step + 1) % check_every == 0:
                finished = bool(done.all()) if any_rank is None else not any_rank(not bool(done.all()))
                if finished:
                    break
            logits = step_logits(token, step)
    finally:
        model.train(was_training)
    stops = set(eos_ids)
    return [_cut(row, stops) for row in torch.stack(out, 1).tolist()]


def _cut(row: list[int], eos: set[int]) -> list[int]:
    """A row up to and including its first EOS."""
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row
