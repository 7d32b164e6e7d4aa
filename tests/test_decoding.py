"""Decoding over a cache of fixed shape (model/decoding.py, what a GPU replays as a CUDA graph): the same completions,
token for token, as the growing cache and as each row decoded alone without a cache, greedy and seeded, alone and
in groups, with padding, with a sliding window; a decoder reused across calls and weight changes; attention of one
query over grouped keys."""

import pytest
import torch
import torch.nn.functional as F

from helpers import ALL, build_checkpoint, hf_model, random_lora_b
from lora_llama import LoraSettings, apply_lora, load_model
from lora_llama.model.generate import sample_completions
from lora_llama.model.sampling import filtered_logits


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def adapted(ckpt):
    model = load_model(ckpt)
    torch.manual_seed(0)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    random_lora_b(model, seed=1)
    return model


@torch.no_grad()
def alone(model, prompt, n, temperature, seed, eos=()):
    """One row decoded by itself, no cache, no padding: the whole sequence through the model each step, the token
    picked by inverse transform from the row's own generator, one draw a step."""
    g = torch.Generator().manual_seed(seed)
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq]))[:, -1]
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            cdf = filtered_logits(logits, temperature, None, None).softmax(-1).cumsum(-1)[0]
            u = torch.rand((), generator=g, dtype=torch.float64)
            token = min(int(torch.searchsorted(cdf, (u * cdf[-1].double()).float()[None])), cdf.numel() - 1)
        seq.append(token)
        if token in eos:
            break
    return seq[len(prompt) :]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("group", [1, 3])
def test_static_decoding_gives_the_completions_of_each_row_alone(tiny_ckpt, temperature, group):
    model = adapted(tiny_ckpt)
    prompts = [p for p in prompts_of((3, 7, 1), seed=4) for _ in range(group)]  # left padding of 4 and 6
    seeds = list(range(10, 10 + len(prompts)))
    runs = {
        static: sample_completions(
            model, prompts, 9, eos_ids=[], pad_id=0, temperature=temperature, seeds=seeds, group=group, static=static
        )
        for static in (False, True)
    }
    want = [alone(model, p, 9, temperature, s) for p, s in zip(prompts, seeds)]
    assert runs[True] == runs[False] == want


def test_a_failed_capture_decodes_eagerly_with_the_same_tokens(tiny_ckpt, monkeypatch):
    """A CUDA graph capture that raises (a compile or a host sync inside it) leaves the step to the eager forward:
    one warning for the process, the same completions, and the decoder stays eager."""
    import lora_llama.model.decoding as decoding

    model = adapted(tiny_ckpt)
    prompts, seeds = prompts_of((3, 7, 1), seed=4), [10, 11, 12]
    want = sample_completions(model, prompts, 9, eos_ids=[], pad_id=0, temperature=1.0, seeds=seeds, static=True)
    model.__dict__.pop("_static_decoders", None)
    made, tries = decoding.StaticDecoder.__init__, []

    def capturing(self, *a):  # as on CUDA, warmed up: the next step captures
        made(self, *a)
        self.graphed = self.warm = True

    def failing_capture(self):
        tries.append(self)
        raise RuntimeError("operation not permitted when stream is capturing (injected)")

    monkeypatch.setattr(decoding.StaticDecoder, "__init__", capturing)
    monkeypatch.setattr(decoding.StaticDecoder, "_capture", failing_capture)
    monkeypatch.setattr(decoding, "_capture_failed", False)
    with pytest.warns(UserWarning, match="CUDA graph capture failed .*injected") as said:
        got = sample_completions(model, prompts, 9, eos_ids=[], pad_id=0, temperature=1.0, seeds=seeds, static=True)
        again = sample_completions(model, prompts, 9, eos_ids=[], pad_id=0, temperature=1.0, seeds=seeds, static=True)
    assert got == again == want and len(tries) == 1
    assert len([w for w in said if "CUDA graph capture" in str(w.message)]) == 1


def test_static_decoding_stops_rows_at_their_eos_between_checks(tiny_ckpt):
    """A GPU asks whether every row has stopped every READ_EVERY tokens: the steps past a row's EOS change nothing."""
    model = adapted(tiny_ckpt)
    prompts = prompts_of((4, 6), seed=5)
    free = sample_completions(model, prompts, 20, eos_ids=[], pad_id=0, temperature=0, static=False)
    stop = {free[0][2], free[1][4]}
    eager, static = (
        sample_completions(model, prompts, 20, eos_ids=stop, pad_id=0, temperature=0, static=s) for s in (False, True)
    )
    cut = [next((c[: i + 1] for i, t in enumerate(c) if t in stop), c) for c in free]
    assert static == eager == cut and all(len(c) <= 5 for c in cut)


def test_a_kept_decoder_serves_later_calls_and_the_weights_of_the_moment(tiny_ckpt):
    """The second call reuses the first's decoder (its cache still holds the longer prompts' keys, which must not
    leak), and an adapter changed in place between calls is what the next call samples from."""
    from lora_llama.model.decoding import decoder_for

    model = adapted(tiny_ckpt)
    first = sample_completions(
        model, prompts_of((9, 8), seed=6), 6, eos_ids=[], pad_id=0, temperature=1.0, seeds=[1, 2], static=True
    )
    decoder = decoder_for(model, 2, 9 + 6)
    short = prompts_of((2, 3), seed=7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)
    got = sample_completions(model, short, 6, eos_ids=[], pad_id=0, temperature=1.0, seeds=[1, 2], static=True)
    assert decoder_for(model, 2, 2 + 6 + 1) is decoder and len(first) == 2
    assert got == [alone(model, p, 6, 1.0, s) for p, s in zip(short, [1, 2])]


def test_generate_on_the_static_path_streams_the_tokens_of_the_growing_cache(tiny_ckpt):
    """`lora-llama generate`'s loop over a StaticDecoder, tokens read every READ_EVERY steps: greedy equals
    transformers; seeded with top-k and top-p equals the growing cache and no cache at all (one draw a step from the
    same generator); an EOS inside a chunk of unread tokens ends the text there, and on_token saw exactly the
    returned tokens; a second, shorter prompt reuses the decoder."""
    from lora_llama.model.decoding import decoder_for
    from lora_llama.model.generate import READ_EVERY, generate

    prompt, short = prompts_of((7, 4), seed=9)
    n = 2 * READ_EVERY + 5  # the last chunk is partial
    want = hf_model(tiny_ckpt).generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :]
    assert generate(load_model(tiny_ckpt), prompt, n, static=True) == want.tolist()
    model = adapted(tiny_ckpt)
    greedy = generate(model, prompt, n, static=True)
    assert greedy == generate(model, prompt, n, static=False) == generate(model, prompt, n, use_cache=False)
    seeded = dict(temperature=1.0, top_k=50, top_p=0.9, seed=5)
    assert (
        generate(model, prompt, n, static=True, **seeded)
        == generate(model, prompt, n, static=False, **seeded)
        == generate(model, prompt, n, use_cache=False, **seeded)
    )
    decoder = decoder_for(model, 1, len(prompt) + n)
    free = generate(model, short, n, static=False, **seeded)
    stop = next(t for t in free[READ_EVERY + 1 :] if free.index(t) > READ_EVERY)  # first seen inside the 2nd chunk
    streamed = []
    got = generate(model, short, n, eos_ids=[stop], static=True, on_token=streamed.append, **seeded)
    assert got == streamed == free[: free.index(stop) + 1] and READ_EVERY < len(got) < n
    assert decoder_for(model, 1, len(short) + n) is decoder


def test_calls_of_nearby_batch_sizes_share_one_decoder_and_keep_their_completions(tiny_ckpt):
    """Rows are bucketed (1, 2, 4, then multiples of 8): 7 rows and then 5 share the decoder of 8, whose idle rows
    (and the rows the first call left in its cache) change nothing; each row is what it gives decoded alone."""
    from lora_llama.model.decoding import bucket_rows, decoder_for

    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 24, 32, 40]
    model = adapted(tiny_ckpt)
    seeds = list(range(7))
    seven = prompts_of((6, 9, 4, 7, 8, 5, 3), seed=2)
    got = sample_completions(model, seven, 6, eos_ids=[], pad_id=0, temperature=1.0, seeds=seeds, static=True)
    decoder = decoder_for(model, 7, 9 + 6)
    assert decoder.cache.k[0].shape[0] == 8 and got == [alone(model, p, 6, 1.0, s) for p, s in zip(seven, seeds)]
    five = prompts_of((5, 2, 8, 4, 6), seed=3)
    got = sample_completions(model, five, 6, eos_ids=[], pad_id=0, temperature=0.0, static=True)
    assert decoder_for(model, 5, 8 + 6) is decoder and got == [alone(model, p, 6, 0.0, 0) for p in five]


def test_a_sliding_window_holds_in_the_static_cache(tmp_path):
    """Mistral's window: a new token sees only the last `window` keys, masked on the device."""
    ckpt = build_checkpoint(tmp_path / "m", family="mistral", sliding_window=5)
    model = load_model(ckpt)
    prompts = prompts_of((6, 3), seed=8)
    eager, static = (
        sample_completions(model, prompts, 8, eos_ids=[], pad_id=0, temperature=0, static=s) for s in (False, True)
    )
    assert static == eager == [alone(model, p, 8, 0.0, 0) for p in prompts]


def test_one_query_attention_over_grouped_keys_equals_sdpa_on_repeated_ones():
    from lora_llama.kernels.attention import one_query

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, heads, n, 8, generator=g) for heads, n in ((6, 1), (2, 11), (2, 11)))
    mask = torch.rand(3, 1, 1, 11, generator=g) > 0.3
    mask[..., -1] = True
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask)
    assert torch.allclose(one_query(q, k, v, mask), want, atol=1e-6)
