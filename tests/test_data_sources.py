"""Several data sources in one recipe (data.sources): drawn by weight, seeded, held out alike, resumed exactly."""

import json
import re

import pytest
from test_reliability import run_cli

from lora_llama.data.sources import allotment, mix, next_source
from lora_llama.errors import UserError
from lora_llama.recipe.schema import load_recipe

WEIGHTS = [0.5, 0.3, 0.2]


def test_the_mixture_gives_each_source_its_weight_to_within_a_row_from_its_seed_alone():
    parts = [[("a", i) for i in range(700)], [("b", i) for i in range(500)], [("c", i) for i in range(800)]]
    rows, counts = mix(parts, WEIGHTS, seed=3)
    assert len(rows) == 2000 == sum(counts) and counts == [1000, 600, 400]
    for part, n in zip(parts, counts):
        assert sum(r[0] == part[0][0] for r in rows) == n
    assert len({r[0] for r in rows[:20]}) == 3  # shuffled together, not one source after another
    # a source drawn past its size starts a new pass (b: 500 examples, ~600 rows), a large one is subsampled
    drawn_b = [r for r in rows if r[0] == "b"]
    assert len(set(drawn_b)) == 500 < len(drawn_b)
    assert mix(parts, WEIGHTS, seed=3) == (rows, counts) and mix(parts, WEIGHTS, seed=4)[0] != rows


@pytest.mark.parametrize("total", [1, 2, 7, 100, 401, 999])
@pytest.mark.parametrize("weights", [WEIGHTS, [1.0, 1.0, 1.0], [0.7, 0.2, 0.05, 0.05], [3.0, 1.0]])
def test_largest_remainder_allots_each_share_within_one_row(weights, total):
    """Hand-checkable: every count within one row of its exact share, the counts adding up to the total, and the
    rows left over after the whole parts go to the largest remainders."""
    counts = allotment(weights, total)
    exact = [total * w / sum(weights) for w in weights]
    assert sum(counts) == total and all(abs(n - x) < 1 for n, x in zip(counts, exact)), (counts, exact)
    assert allotment([0.5, 0.3, 0.2], 7) == [4, 2, 1]  # 3.5, 2.1, 1.4: floors 3, 2, 1; the one left to 0.5's


def test_a_stream_stays_within_one_row_of_the_weights_at_every_point():
    given = [0, 0, 0]
    for row in range(1, 1001):
        given[next_source(WEIGHTS, given)] += 1
        assert all(abs(g - row * w) < 1 for g, w in zip(given, WEIGHTS)), (row, given)


def three_sources(tmp_path, n=(1000, 600, 400)):
    """A JSONL in messages form, a ShareGPT file and a text corpus."""
    messages, sharegpt, text = tmp_path / "messages.jsonl", tmp_path / "sharegpt.json", tmp_path / "corpus.txt"
    messages.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}
            )
            + "\n"
            for i in range(n[0])
        )
    )
    rows = [
        {"conversations": [{"from": "human", "value": f"h {i}"}, {"from": "gpt", "value": f"g {i}"}]}
        for i in range(n[1])
    ]
    sharegpt.write_text(json.dumps(rows))
    text.write_text("".join(f"the line {i} of a small corpus\n" for i in range(n[2])))
    return [
        {"source": str(messages), "weight": 0.5, "format": "chat"},
        {"source": str(sharegpt), "weight": 0.3, "format": "chat"},
        {"source": str(text), "weight": 0.2, "format": "text"},
    ]


def sources_args(tiny_ckpt, sources, out, *extra):
    recipe = out.parent / "sources.yaml"
    recipe.write_text(f"model: {{source: {tiny_ckpt}}}\n")
    return [
        "train",
        str(recipe),
        f"data.sources={json.dumps(sources)}",
        "data.val_size=0.05",
        "data.max_seq_len=32",
        f"output.dir={out}",
        "train.batch_size=4",
        "train.max_steps=4",
        "train.warmup_steps=0",
        "train.eval_every=100",
        "train.save_every=2",
        "lora.dropout=0.0",
        *extra,
    ]


@pytest.mark.slow  # ~35 s: a run killed and resumed in subprocesses
def test_three_sources_train_in_their_proportions_and_a_killed_run_resumes_exactly(tiny_ckpt, tmp_path):
    sources = three_sources(tmp_path)
    out, err, code = run_cli(sources_args(tiny_ckpt, sources, tmp_path / "whole"))
    assert code == 0, err[-2000:]
    first = json.loads((tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[0])
    counts = [first[f"data/{i}/rows"] for i in range(3)]
    assert sum(counts) >= 1900  # each source's training share (95% of it) put together
    for n, weight in zip(counts, WEIGHTS):
        assert abs(n - weight * sum(counts)) < 1, counts  # within one row of the weight
    shares = re.findall(r"\(([\d.]+)%, weight ([\d.]+),", out + err)  # the log line's share of each source
    assert [(float(s), float(w)) for s, w in shares] == [
        (round(100 * n / sum(counts), 1), w) for n, w in zip(counts, WEIGHTS)
    ]
    # killed (-9) right after the checkpoint of step 2, then the same command again: the uninterrupted adapter
    assert_killed_run_resumes_exactly(tiny_ckpt, sources, tmp_path)


KILL_AFTER_STEP_2 = """import lora_llama.training.checkpoints as c
_save = c.Checkpoints.save
def save(self, step, *a, **k):
    path = _save(self, step, *a, **k)
    if step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return path
c.Checkpoints.save = save
"""


def assert_killed_run_resumes_exactly(tiny_ckpt, sources, tmp_path, *extra):
    """A run of the sources killed (-9) right after its checkpoint of step 2, then the same command again, ends
    with the adapter of the run in tmp_path/whole (difference 0.0)."""
    from safetensors.torch import load_file

    args = sources_args(tiny_ckpt, sources, tmp_path / "killed", *extra)
    assert run_cli(args, patch=KILL_AFTER_STEP_2)[2] == -9
    out, err, code = run_cli(args)
    assert code == 0 and "resuming from" in out + err, err[-2000:]
    whole = load_file(tmp_path / "whole" / "adapter" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "killed" / "adapter" / "adapter_model.safetensors")
    assert all(float((whole[k] - resumed[k]).abs().max()) == 0.0 for k in whole)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.source=x.jsonl", 'data.sources=[{"source": "y.jsonl"}]'], "set data.source or data.sources, not both"),
        (["data.sources=[]"], "data.sources needs at least one source"),
        (['data.sources=[{"source": "y.jsonl", "weight": 0}]'], "data.sources.0.weight"),
        (['data.sources=[{"source": "y.jsonl", "format": "prompt"}]'], "not prompt"),
    ],
)
def test_bad_sources_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_recipe(None, overrides)


def test_a_second_run_reads_its_tokenized_examples_from_the_cache(tiny_ckpt, tmp_path, monkeypatch):
    """The same recipe again: the examples come from the cache, equal to those tokenized; a changed file, another
    objective setting or another seed tokenizes afresh."""
    from test_train import chat_file

    from lora_llama.training.from_recipe import _examples

    monkeypatch.setenv("LORA_LLAMA_CACHE", str(tmp_path / "cache"))
    data = chat_file(tmp_path / "d.jsonl")
    overrides = [f"model.source={tiny_ckpt}", f"data.source={data}", "data.packing=true", "data.max_seq_len=64"]
    from lora_llama.loading.models import load_tokenizer

    tok = load_tokenizer(str(tiny_ckpt))

    def examples(*extra):
        lines = []
        train, val, _ = _examples(load_recipe(None, [*overrides, *extra]), tok, lines.append)
        return train, val, " ".join(lines)

    first, again = examples(), examples()
    assert "kept for the next run" in first[2] and "read from the cache" in again[2]
    assert again[:2] == first[:2] and len(first[0]) > 0
    assert "read from the cache" not in examples("train.seed=1")[2]
    assert examples("data.val_size=0")[1] == [] and "read from the cache" in examples("data.val_size=0")[2]
    data.write_text(data.read_text() + json.dumps({"messages": [{"role": "user", "content": "new"}]}) + "\n")
    assert "read from the cache" not in examples()[2]


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_cached_pairs_and_feedback_read_back_as_tokenized(preference_ckpt, tmp_path, monkeypatch, objective):
    from helpers import PREFERENCE_ROWS, preference_file
    from lora_llama.loading.models import load_tokenizer
    from lora_llama.training.from_recipe import _examples

    monkeypatch.setenv("LORA_LLAMA_CACHE", str(tmp_path / "cache"))
    data = preference_file(tmp_path / "pairs.jsonl", PREFERENCE_ROWS * 3)
    recipe = load_recipe(
        None, [f"data.source={data}", "data.format=preference", f"train.objective={objective}", "data.val_size=0.25"]
    )
    tok, lines = load_tokenizer(str(preference_ckpt)), []
    first = _examples(recipe, tok, lines.append)[:2]
    assert _examples(recipe, tok, lines.append)[:2] == first and "read from the cache" in lines[-1]


def test_a_glob_of_files_reads_them_all_in_order_and_one_that_matches_none_is_one_line(tmp_path):
    from lora_llama.data.loading import load_records

    for i in range(3):
        (tmp_path / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": f"{i} {j}"}) + "\n" for j in range(2)))
    records = load_records(str(tmp_path / "part-*.jsonl"))
    assert records["text"] == ["0 0", "0 1", "1 0", "1 1", "2 0", "2 1"]
    assert load_records(str(tmp_path / "part-*.jsonl"), split="train[:50%]")["text"] == ["0 0", "0 1", "1 0"]
    with pytest.raises(UserError, match="no file matches"):
        load_records(str(tmp_path / "nothing-*.jsonl"))
    (tmp_path / "part-3.csv").write_text("text\nx\n")
    with pytest.raises(UserError, match="files of type .csv, .jsonl"):
        load_records(str(tmp_path / "part-*"))
