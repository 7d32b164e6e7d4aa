"""data.streaming: sources read as streams give the in-memory path's examples, shuffled by a seed, mixed by weight,
packed as they come; a killed run resumes exactly; memory does not grow with the corpus."""

import itertools
import json

import pytest
from test_data_sources import assert_killed_run_resumes_exactly, sources_args, three_sources
from test_reliability import run_cli

from helpers import PEAK_MEMORY_HELPERS, fresh_python
from lora_llama.data.loading import load_records
from lora_llama.data.sft import pack, tokenize_records
from lora_llama.data.sources import source_sections
from lora_llama.data.streaming import StreamedExamples
from lora_llama.errors import UserError
from lora_llama.loading.models import load_tokenizer, model_source
from lora_llama.recipe.schema import DataSection, load_recipe


def conversations(path, n=40, bad=(3, 17)):
    """A JSONL of n conversations in messages form; the rows in `bad` (counted from 1) have no messages."""
    rows = [
        {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
        if i + 1 not in bad
        else {"text": "no messages here"}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stream(tiny_ckpt, *overrides, log=None):
    recipe = load_recipe(None, [f"model.source={tiny_ckpt}", "data.streaming=true", *overrides])
    tok = load_tokenizer(model_source(str(tiny_ckpt)))
    return StreamedExamples(source_sections(recipe.data), tok, recipe.train.seed, log or (lambda *_: None)), tok


def ids(examples):
    return [(e["input_ids"], e["labels"]) for e in examples]


@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_read_in_order_gives_the_in_memory_examples_pass_after_pass(tiny_ckpt, tmp_path, packing):
    """buffer_size 0 reads the records in order: the stream's examples are tokenize_records' on the whole file,
    then the same again (the second pass); packed, they are `pack` over those two passes. The bad rows are said
    once, with their numbers."""
    data = conversations(tmp_path / "c.jsonl")
    said = []
    streamed, tok = stream(
        tiny_ckpt,
        f"data.source={data}",
        "data.format=auto",
        "data.buffer_size=0",
        f"data.packing={str(packing).lower()}",
        "data.max_seq_len=48",
        log=said.append,
    )
    records = load_records(str(data)).filter(lambda r: r["messages"] is not None)
    want = tokenize_records(records, tok, DataSection(format="chat", max_seq_len=48))
    assert len(want) == 38
    if packing:
        want = pack(want + want, 48)[:-1]  # the last row of two passes still fills from the third
    got = list(itertools.islice(streamed.rows(), len(want) if packing else 2 * len(want)))
    assert ids(got) == ids(want if packing else want + want)
    assert [line for line in said if "skipped" in line] == [
        f"warning: skipped 2 of 40 rows of {data}: 2 with a null 'messages' (rows 3, 17)"
    ]


def test_a_shuffled_stream_is_a_seeded_permutation_of_each_pass(tiny_ckpt, tmp_path):
    data = conversations(tmp_path / "c.jsonl", bad=())
    args = [f"data.source={data}", "data.buffer_size=16", "data.max_seq_len=48"]
    in_order = ids(itertools.islice(stream(tiny_ckpt, *args[:1], "data.buffer_size=0")[0].rows(), 40))
    first = ids(itertools.islice(stream(tiny_ckpt, *args)[0].rows(), 80))
    again = ids(itertools.islice(stream(tiny_ckpt, *args)[0].rows(), 80))
    other_seed = ids(itertools.islice(stream(tiny_ckpt, *args, "train.seed=7")[0].rows(), 40))
    assert first == again and first[:40] != in_order and other_seed != first[:40]
    for one_pass in (first[:40], first[40:], other_seed):
        assert sorted(one_pass) == sorted(in_order)
    assert first[40:] != first[:40]  # each pass in its own order


def test_streamed_sources_are_drawn_by_their_weights(tiny_ckpt, tmp_path):
    a = conversations(tmp_path / "a.jsonl", n=30, bad=())
    b = tmp_path / "b.txt"
    b.write_text("".join(f"line {i} of the corpus\n" for i in range(50)))
    sources = [{"source": str(a), "weight": 0.7}, {"source": str(b), "weight": 0.3, "format": "text"}]
    streamed, tok = stream(tiny_ckpt, f"data.sources={json.dumps(sources)}", "data.max_seq_len=48")
    rows = list(itertools.islice(streamed.rows(), 2000))
    from_a = sum(tok.decode(r["input_ids"]).find("question") >= 0 for r in rows)
    assert abs(from_a / 2000 - 0.7) < 0.03, from_a


@pytest.mark.slow  # ~33 s: a run killed and resumed in subprocesses
def test_a_killed_streamed_run_resumes_exactly(tiny_ckpt, tmp_path):
    """kill -9 right after the checkpoint of step 2, then the same command: the adapter an uninterrupted run
    gives, over three sources read as streams, shuffled and packed."""

    sources = three_sources(tmp_path)
    extra = ["data.streaming=true", "data.buffer_size=64", "data.packing=true", "data.val_size=0"]
    out, err, code = run_cli(sources_args(tiny_ckpt, sources, tmp_path / "whole", *extra))
    assert code == 0, err[-2000:]
    assert "streamed train" in out + err
    assert_killed_run_resumes_exactly(tiny_ckpt, sources, tmp_path, *extra)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.epochs=1"], "data.streaming has no length to count epochs in: set train.max_steps"),
        (["train.objective=dpo", "data.format=auto"], "data.streaming is read by train.objective sft, not dpo"),
    ],
)
def test_what_a_stream_cannot_do_is_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_recipe(None, ["data.streaming=true", *overrides])


def test_a_source_with_no_usable_row_is_one_line(tiny_ckpt, tmp_path):
    data = conversations(tmp_path / "c.jsonl", n=4, bad=(1, 2, 3, 4))
    with pytest.raises(UserError, match="gives no training example"):
        next(stream(tiny_ckpt, f"data.source={data}", "data.format=chat")[0].rows())


READ_A_STREAM = """
import itertools, sys
from lora_llama.data.sources import source_sections
from lora_llama.data.streaming import StreamedExamples
from lora_llama.loading.models import load_tokenizer, model_source
from lora_llama.recipe.schema import load_recipe
recipe = load_recipe(None, [f"data.source={sys.argv[1]}", "data.format=text", "data.streaming=true",
                            "data.packing=true", "data.max_seq_len=128", "data.buffer_size=1000"])
tok = load_tokenizer(model_source(sys.argv[2]))
rows = StreamedExamples(source_sections(recipe.data), tok, 0, print).rows()
"""


@pytest.mark.slow
def test_reading_a_stream_takes_the_same_memory_from_a_corpus_twenty_times_larger(tiny_ckpt, tmp_path):
    """The peak resident memory of a process that reads 3,000 packed rows of a 6 MB corpus and of a 120 MB one
    (each line a record) is the same within 10%: the stream reads blocks of the file, never the whole."""
    line = "a line of the corpus that the stream reads as one record, and tokenizes when it is drawn\n"
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    small.write_text(line * (6_000_000 // len(line)))
    with large.open("w") as f:
        for _ in range(20):
            f.write(line * (6_000_000 // len(line)))
    work = "for row in itertools.islice(rows, 3000): pass\n"
    script = READ_A_STREAM + work + "print(json.dumps({'peak_kb': status_kb('VmHWM')}))\n"
    peaks = [
        fresh_python(PEAK_MEMORY_HELPERS + "import json\n" + script, f, tiny_ckpt)["peak_kb"] for f in (small, large)
    ]
    assert abs(peaks[1] / peaks[0] - 1) < 0.10, peaks
