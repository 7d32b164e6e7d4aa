"""lora-llama's lm-eval model against lm-eval's own hf backend with peft (`lm_eval --model hf --model_args
pretrained=...,peft=...`) on local tasks: multiple-choice accuracy identical, every log-likelihood within 1e-4, greedy
generations identical, in fp32 on the CPU; and `lora-llama eval --tasks` end to end, with its refusals."""

import json

import pytest

from helpers import make_adapter, one_error_line
from lora_llama.cli import main

pytest.importorskip("lm_eval")

QUESTIONS = [
    ("what is the capital of france?", ["paris", "rome", "lima"], 0),
    ("the quick brown fox jumps over the", ["cat", "lazy dog", "moon"], 1),
    ("to be or not to be, that is the", ["answer", "end", "question"], 2),
    ("hello world, how are you", ["today?", "fine", "there"], 0),
    ("what is up", ["the sky", "down", "left"], 0),
]


def local_tasks(folder):
    """A multiple-choice task and a generation task (exact match, stopping at a newline), each a YAML over a JSONL."""
    folder.mkdir()
    rows = [{"question": q, "choices": c, "answer": a, "target": c[a]} for q, c, a in QUESTIONS]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'rows.jsonl'}\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        "task: tiny_mc\n" + data + "output_type: multiple_choice\ndoc_to_text: question\n"
        "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "gen.yaml").write_text(
        "task: tiny_gen\n" + data + "output_type: generate_until\ndoc_to_text: question\n"
        'doc_to_target: target\ngeneration_kwargs:\n  until: ["\\n", "?"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


@pytest.fixture(scope="module")
def setup(tiny_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("harness")
    return tiny_ckpt, make_adapter(tiny_ckpt, d / "adapter", std=0.3), local_tasks(d / "tasks")


def evaluate(lm, tasks_dir):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=lm, tasks=["tiny_mc", "tiny_gen"], task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True
    )


def test_native_backend_equals_lm_evals_hf_backend_with_peft(setup):
    from lm_eval.models.huggingface import HFLM

    from lora_llama import load_adapter, load_model, load_tokenizer
    from lora_llama.harness.lm import native_lm

    base, adapter, tasks = setup
    model = load_model(base)
    load_adapter(model, adapter)
    ours = evaluate(native_lm(model, load_tokenizer(base), batch_size=3), tasks)
    ref = evaluate(HFLM(pretrained=str(base), peft=str(adapter), device="cpu", dtype="float32", batch_size=3), tasks)
    assert ours["results"]["tiny_mc"]["acc,none"] == ref["results"]["tiny_mc"]["acc,none"]
    for mine, theirs in zip(ours["samples"]["tiny_mc"], ref["samples"]["tiny_mc"], strict=True):
        lls = [r[0][0] for r in mine["resps"]], [r[0][0] for r in theirs["resps"]]
        assert max(abs(a - b) for a, b in zip(*lls, strict=True)) < 1e-4
        assert [r[0][1] for r in mine["resps"]] == [r[0][1] for r in theirs["resps"]]  # greedy flags
    generated = [[s["resps"] for s in run["samples"]["tiny_gen"]] for run in (ours, ref)]
    assert generated[0] == generated[1] and any(r[0][0] for r in generated[0])  # identical and not all empty
    assert ours["results"]["tiny_gen"]["exact_match,none"] == ref["results"]["tiny_gen"]["exact_match,none"]


def test_eval_compare_writes_base_and_adapter(setup, tmp_path, capsys):
    base, adapter, tasks = setup
    out = tmp_path / "r.json"
    argv = ["eval", "--model", str(base), "--adapter", str(adapter), "--tasks", "tiny_mc", "--include-path", str(tasks)]
    assert main([*argv, "--compare", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| tiny_mc | acc,none |" in printed
    written = json.loads(out.read_text())
    assert set(written) == {"base", "adapter"} and "tiny_mc" in written["adapter"]["results"]
    assert main([*argv, "--output", str(out)]) == 2  # an existing result is kept without --force
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "no_such_task"], "unknown lm-eval task 'no_such_task'"),
        (["--tasks", "tiny_mc", "--include-path", "/no/such/dir"], "no such folder"),
        (["--tasks", "tiny_mc", "--compare"], "--compare needs --adapter"),
        ([], "eval needs --data FILE"),
    ],
)
def test_bad_eval_input_is_one_line(setup, tmp_path, capsys, extra, message):
    base, _, tasks = setup
    include = [] if "--include-path" in extra or not extra else ["--include-path", str(tasks)]
    assert main(["eval", "--model", str(base), *include, *extra, "--output", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert one_error_line(err) and message in err and not (tmp_path / "r.json").exists()
