"""Decoding over several turns (model/generate.sample_turns): with the KV cache kept from turn to turn it gives,
token for token, what decoding each turn from the whole conversation gives, and it runs only the new tokens
through the model."""

import pytest
import torch

from lora_llama import load_model
from lora_llama.model.generate import sample_turns
from lora_llama.model.sampling import pick, row_uniforms

EOS, BUDGET = 2, 40
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [20, 21, 22]]


def eos_leaning(model):
    """The model with its EOS logit raised, so that turns end after a few tokens (a random model's rarely do)."""
    forward = model.forward

    def leaning(*args, **kwargs):
        out = forward(*args, **kwargs)
        out[..., EOS] += 3.0
        return out

    model.forward = leaning
    return model


def answers(rounds=2):
    """A respond that adds 3 tokens after each of a row's first `rounds` turns, and the turns it was handed."""
    seen = {}

    def respond(rows, turns):
        for r, t in zip(rows, turns):
            seen.setdefault(r, []).append(t)
        return [[40 + r, 41 + len(seen[r]), 42] if len(seen[r]) <= rounds else None for r in rows]

    return respond, seen


def whole_conversation_turn(model, sequence, n_tokens, u_row, first, temperature):
    """One turn decoded from the whole conversation each step (no cache), the row's uniforms from `first` on."""
    seq, out = list(sequence), []
    for k in range(n_tokens):
        logits = model(torch.tensor([seq]))[:, -1]
        u = None if u_row is None else u_row[None, first + k]
        t = int(pick(logits, temperature, None, None, u))
        out.append(t)
        seq.append(t)
        if t == EOS:
            break
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_turns_over_the_kept_cache_equal_turns_decoded_from_the_whole_conversation(tiny_ckpt, temperature):
    model = eos_leaning(load_model(tiny_ckpt))
    seeds = [11, 12, 13, 14] if temperature else None
    respond, seen = answers()
    pieces = sample_turns(model, PROMPTS, BUDGET, [EOS], 0, respond, temperature=temperature, seeds=seeds)
    u = row_uniforms(seeds, BUDGET, "cpu") if temperature else None
    several = 0
    for r, row in enumerate(pieces):
        sequence, sampled = list(PROMPTS[r]), 0
        for ids, mine in row:
            if mine:
                u_row = None if u is None else u[r]
                want = whole_conversation_turn(model, sequence, len(ids), u_row, sampled, temperature)
                assert ids == want, (r, ids, want)
                sampled += len(ids)
            sequence += ids
        assert len(sequence) - len(PROMPTS[r]) <= BUDGET
        several += sum(mine for _, mine in row) > 1
        # every turn that ended on EOS within the budget was handed to respond, the others were not
        turns = [ids for ids, mine in row if mine]
        assert seen.get(r, []) == [t for t in turns if t and t[-1] == EOS][: len(seen.get(r, []))]
    assert several >= 3  # most rows went on after an answer


def test_only_the_new_tokens_run_through_the_model(tiny_ckpt):
    """After the prompts, each forward takes one token a row, or one block of the answers added after a turn (as
    wide as the longest answer with the turn's last token, which no step fed yet): the conversation so far is
    never run again. A round of turns takes as many one-token steps as its longest turn, less its last token."""
    model = eos_leaning(load_model(tiny_ckpt))
    widths = []
    forward = model.forward

    def counted(input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    model.forward = counted
    respond, _ = answers()
    pieces = sample_turns(model, PROMPTS, 400, [EOS], 0, respond, temperature=0.0)  # room for every turn's EOS
    rounds = [[row[k][0] for row in pieces if len(row) > k] for k in range(0, max(map(len, pieces)), 2)]
    assert all(turn[-1] == EOS for row in pieces for turn, mine in row if mine)
    assert widths[0] == max(map(len, PROMPTS))  # the prompts, once
    assert [w for w in widths[1:] if w > 1] == [4] * (len(rounds) - 1)  # 3 answer tokens + the turn's last
    assert sum(w == 1 for w in widths[1:]) == sum(max(map(len, turns)) - 1 for turns in rounds)
