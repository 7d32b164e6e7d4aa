"""The decoding loop: prompts, left-padded, continued together through the model as it stands (adapters active: no
merge, no copy, no second engine) for `generate`, GRPO's rollouts and lm-eval's generations.

On a GPU the steps after the prompt run over a cache of fixed shape as a replayed CUDA graph (decoding.py), and the
tokens are read to the host, and the stops checked, every READ_EVERY tokens: a read waits for the GPU, so the host
never waits on it mid-run. Over the growing cache (the CPU, fsdp) a read costs less than a step, and every token
is read as it comes."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from lora_llama.model.decoding import decoder_for
from lora_llama.model.sampling import pick, row_uniforms

READ_EVERY = 8  # tokens between reads to the host where a read waits for the device (a few extra steps cost less)


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
    top_k: int | None = None,
    use_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Each prompt's completion (token ids, its first EOS included when it stops before max_new_tokens).
    seeds: one per row (temperature > 0). group: the rows come in runs of `group` equal prompts (GRPO's
    groups), and each prompt is run through the model once, its keys and values copied to its group.
    any_rank: under fsdp, whether any rank says yes; decoding goes on while any rank has rows to finish,
    since every forward gathers weights from all of them. static: decode over a StaticKVCache (decoding.py;
    None: on CUDA with the cache unless under fsdp, where the graph would capture its gathers). stopped: given
    the tokens so far (B, n), which rows are done besides an EOS (stop strings), asked at each read; a done
    row's later tokens are padding. use_cache False: each step runs the whole sequence again (prompts of one
    length). on_token: sees the first row's tokens, in order, as they are read, up to its first EOS."""
    device = next(model.parameters()).device
    static = use_cache and device.type == "cuda" and any_rank is None if static is None else static
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    if not use_cache and (static or len({len(p) for p in prompts}) > 1):
        raise ValueError("decoding without the KV cache takes prompts of one length and no static decoding")
    # fsdp's gathered weights must stay ordinary tensors for its later in-place updates: no_grad, not inference mode
    with torch.no_grad() if any_rank is not None else torch.inference_mode():
        was_training = model.training
        model.eval()
        try:
            steps = _Steps(model, prompts[::group], group, max_new_tokens, pad_id, static, use_cache)
            uniforms = row_uniforms(seeds, max_new_tokens, device) if temperature > 0 else None
            loop = _Loop(set(eos_ids), pad_id, READ_EVERY if static else 1, stopped, any_rank, on_token)
            rows = loop.run(
                steps,
                max_new_tokens,
                lambda logits, step: pick(
                    logits, temperature, top_k, top_p, None if uniforms is None else uniforms[:, step]
                ),
            )
        finally:
            model.train(was_training)
    return [_cut(row, set(eos_ids)) for row in rows]


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
    """Continue one prompt; returns the new token ids (EOS included when it ends the text). seed: the row's
    sampling seed (None: one drawn from torch's generator). static, use_cache, on_token: as sample_completions'."""
    prompt = list(prompt_ids)
    seeds = [int(torch.randint(2**62, ())) if seed is None else seed] if temperature > 0 else None
    options = dict(top_k=top_k, use_cache=use_cache, on_token=on_token, static=static)
    return sample_completions(model, [prompt], max_new_tokens, eos_ids, 0, temperature, top_p, seeds, **options)[0]


def sample_turns(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids,
    pad_id: int,
    respond: Callable[[list[int], list[list[int]]], list[list[int] | None]],
    temperature: float = 1.0,
    top_p: float | None = None,
    seeds: list[int] | None = None,
    group: int = 1,
    top_k: int | None = None,
) -> list[list[tuple[list[int], bool]]]:
    """Completions of several turns: the model's turn, then, for the rows `respond` continues, tokens added after
    it (a tool's answer and the template's markers for the next assistant turn), then the model's next turn, until
    `respond` continues no row. respond(rows, turns) gets the rows still going and each one's last turn (its EOS
    included when it has one) and returns, for each, the tokens to add or None (the row is finished).

    A completion (turns and added tokens together) keeps to max_new_tokens, as trl's does: tokens that would
    pass it are not added and the row ends, a turn is cut where it reaches it. The cache is kept from turn to turn
    (only the added tokens run through the model), all rows advance together, and a row's sampling uniforms run
    on across its turns (its n-th token takes its n-th uniform, as if the turns were one completion). Returns, per
    row, its pieces in order: (token ids, True for the model's own, False for added ones)."""
    device = next(model.parameters()).device
    eos = set(eos_ids)
    with torch.inference_mode():
        was_training = model.training
        model.eval()
        try:
            steps = _TurnSteps(model, prompts[::group], group, max_new_tokens, pad_id)
            rows = len(prompts)
            uniforms = row_uniforms(seeds, max_new_tokens, device) if temperature > 0 else None
            pieces: list[list[tuple[list[int], bool]]] = [[] for _ in range(rows)]
            used, sampled = [0] * rows, torch.zeros(rows, dtype=torch.long, device=device)
            going = list(range(rows))
            loop = _Loop(eos, pad_id, 1, None, None, None)

            choose = _picker(uniforms, sampled, temperature, top_k, top_p)
            while going:
                done = torch.ones(rows, dtype=torch.bool, device=device)
                done[going] = False
                budget = max(max_new_tokens - used[i] for i in going)
                steps.start_turn(budget)
                out = loop.run(steps, budget, choose, done)
                turns = [_cut(out[i], eos)[: max_new_tokens - used[i]] for i in going]
                for i, turn in zip(going, turns):
                    pieces[i].append((turn, True))
                    used[i] += len(turn)
                    sampled[i] += len(turn)
                steps.close_turn(going, turns)
                additions = _added(respond, going, turns, used, eos, max_new_tokens)
                for i, more in additions.items():
                    pieces[i].append((more, False))
                    used[i] += len(more)
                if additions:
                    steps.add(additions)
                going = [i for i in additions if used[i] < max_new_tokens]  # an addition may fill the completion
        finally:
            model.train(was_training)
    return pieces


def _picker(uniforms: torch.Tensor | None, sampled: torch.Tensor, temperature: float, top_k, top_p):
    """choose(logits, step) for a turn: each row's token takes its uniform of index (its tokens so far + step)."""

    def choose(logits, step):
        u = None
        if uniforms is not None:
            u = uniforms.gather(1, (sampled + step).clamp(max=uniforms.shape[1] - 1)[:, None])[:, 0]
        return pick(logits, temperature, top_k, top_p, u)

    return choose


def _added(respond, going: list[int], turns: list[list[int]], used: list[int], eos: set[int], limit: int) -> dict:
    """What respond adds after the turns that ended on EOS with room left, for the rows whose addition fits."""
    asked = [(i, t) for i, t in zip(going, turns) if used[i] < limit and t and t[-1] in eos]
    added = respond([i for i, _ in asked], [t for _, t in asked]) if asked else []
    return {i: list(more) for (i, _), more in zip(asked, added) if more and used[i] + len(more) <= limit}


def _last_logits(model, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """Run a block of ids (B, T) into the cache; the logits (B, V) at its last column (rows are right-aligned)."""
    last = torch.zeros_like(ids, dtype=torch.bool)
    last[:, -1] = True
    return model(ids, position_ids=positions, cache=cache, keep=last)


class _TurnSteps:
    """The decoding steps of sample_turns over one growing cache: each row's positions run on by its own tokens,
    and a position that holds padding (after a row's EOS, before a shorter addition) is never a key."""

    def __init__(self, model, prompts, group: int, room: int, pad_id: int):
        device = next(model.parameters()).device
        ids, positions, key_mask = left_padded(prompts, pad_id, room, device)
        self.model, self.pad_id = model, pad_id
        self.cache = model.new_cache(ids.shape[0], key_mask.shape[1], key_mask)
        self.first = _last_logits(model, ids, positions, self.cache).repeat_interleave(group, 0)
        self.cache.repeat_rows(group)
        self.next_pos = positions[:, -1].repeat_interleave(group, 0) + 1
        self.turn_start = self.cache.pos

    def start_turn(self, room: int) -> None:
        """A turn of up to `room` tokens starts here: the cache has room for them."""
        self.cache.make_room(room)
        self.turn_start = self.cache.pos

    def after(self, token: torch.Tensor, step: int, fed: torch.Tensor) -> torch.Tensor:
        column = self.cache.pos
        self.cache.key_mask[:, column] = fed
        logits = self.model(token[:, None], position_ids=self.next_pos[:, None], cache=self.cache)[:, -1]
        self.next_pos += fed.long()
        return logits

    def close_turn(self, going: list[int], turns: list[list[int]]) -> None:
        """After a turn: the tokens past each row's kept turn are no keys. A turn's last token is fed to the cache
        only by the next step, so a row's whole turn is in it only if the loop ran past its end."""
        written = self.cache.pos - self.turn_start  # tokens of the turn whose keys are in the cache
        mask = self.cache.key_mask
        mask[:, self.turn_start : self.cache.pos] = False
        self.pending = {}
        for i, turn in zip(going, turns):
            kept = min(len(turn), written)
            mask[i, self.turn_start : self.turn_start + kept] = True
            self.pending[i] = turn[kept:]  # still to run through the model before what comes next

    def add(self, additions: dict[int, list[int]]) -> None:
        """Run each continued row's unfed turn tokens and its addition through the model, right-aligned in one
        block (the other rows: padding, no keys); the logits at the block's last column start the next turn."""
        rows = self.cache.k[0].shape[0]
        seqs = {i: self.pending.get(i, []) + more for i, more in additions.items()}
        width = max(len(t) for t in seqs.values())
        device = self.next_pos.device
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        real = torch.zeros((rows, width), dtype=torch.bool)
        positions = torch.zeros((rows, width), dtype=torch.long)
        start = self.next_pos.cpu()
        for i, seq in seqs.items():
            ids[i, width - len(seq) :] = torch.tensor(seq)
            real[i, width - len(seq) :] = True
            positions[i, width - len(seq) :] = start[i] + torch.arange(len(seq))
        self.cache.make_room(width)
        self.cache.key_mask[:, self.cache.pos : self.cache.pos + width] = real.to(device)
        self.first = _last_logits(self.model, ids.to(device), positions.to(device), self.cache)
        self.next_pos = self.next_pos + real.sum(1).to(device)


class _Steps:
    """The logits (rows, V) of each decoding step: the prompts' last positions first (each prompt run once and
    its keys and values copied to its group), then after each token, over the static decoder, the growing cache
    or, without a cache, the whole sequence again."""

    def __init__(self, model, prompts, group: int, max_new_tokens: int, pad_id: int, static: bool, use_cache: bool):
        device = next(model.parameters()).device
        ids, positions, key_mask = left_padded(prompts, pad_id, max_new_tokens, device)
        self.model, self.group, self.decoder, self.cache = model, group, None, None
        if not use_cache:
            self.ids = ids.repeat_interleave(group, 0)
            self.first = model(self.ids)[:, -1]
            return
        padded = len({len(p) for p in prompts}) > 1
        cache = model.new_cache(ids.shape[0], key_mask.shape[1], key_mask if padded or static else None)
        self.first = _last_logits(model, ids, positions, cache).repeat_interleave(group, 0)
        self.next_pos = positions[:, -1].repeat_interleave(group, 0) + 1
        if static:
            self.decoder = decoder_for(model, len(prompts) * group, key_mask.shape[1])
            self.decoder.load(cache, group, self.next_pos)
        else:
            self.cache = cache
            if group > 1:
                cache.repeat_rows(group)

    def after(self, token: torch.Tensor, step: int, fed: torch.Tensor) -> torch.Tensor:
        """The logits after `token` (rows,), the step-th token of each row (fed: the rows it is not padding of)."""
        if self.decoder is not None:
            return self.decoder.step(token)
        if self.cache is None:
            self.ids = torch.cat([self.ids, token[:, None]], 1)
            return self.model(self.ids)[:, -1]
        return self.model(token[:, None], position_ids=(self.next_pos + step)[:, None], cache=self.cache)[:, -1]


class _Loop:
    """Picks each row's tokens; every `read_every` tokens reads them to the host, streams the first row's, asks
    which rows have stopped and stops when all have (on every rank)."""

    def __init__(self, eos: set[int], pad_id: int, read_every: int, stopped, any_rank, on_token):
        self.eos, self.pad_id, self.read_every = eos, pad_id, read_every
        self.stopped, self.any_rank, self.on_token = stopped, any_rank, on_token

    def run(self, steps, max_new_tokens: int, choose, done: torch.Tensor | None = None) -> list[list[int]]:
        """Each row's tokens (max_new_tokens or fewer, padding after its EOS); rows `done` to begin with get only
        padding."""
        logits = steps.first
        eos = torch.tensor(sorted(self.eos), device=logits.device, dtype=torch.long)
        done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device) if done is None else done.clone()
        out, streamed = [], 0
        for step in range(max_new_tokens):
            token = choose(logits, step).masked_fill(done, self.pad_id)
            out.append(token)
            fed = ~done
            done |= torch.isin(token, eos)
            last = step == max_new_tokens - 1
            if (step + 1) % self.read_every == 0 or last:
                if self.stopped is not None:
                    done |= self.stopped(torch.stack(out, 1)).to(done.device)
                if self.on_token is not None:
                    streamed = self._stream(out, streamed)
                every_row = bool(done.all())
                if every_row if self.any_rank is None else not self.any_rank(not every_row):
                    break
            if not last:
                logits = steps.after(token, step, fed)
        return torch.stack(out, 1).tolist()

    def _stream(self, out: list[torch.Tensor], streamed: int) -> int:
        """Hands the first row's unread tokens to on_token, up to its first EOS; returns how many it has read (-1
        once the EOS is read)."""
        if streamed < 0:
            return streamed
        for t in torch.stack(out[streamed:])[:, 0].tolist():
            self.on_token(t)
            if t in self.eos:
                return -1
        return len(out)


def _cut(row: list[int], eos: set[int]) -> list[int]:
    """A row up to and including its first EOS."""
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row
