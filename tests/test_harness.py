"""lora-llama's lm-eval model against lm-eval's own hf backend with peft (`lm_eval --model hf --model_args
pretrained=...,peft=...`) on local tasks: multiple-choice accuracy identical, every log-likelihood within 1e-4, greedy
generations identical, in fp32 on the CPU; and `lora-llama eval --tasks` end to end, with its refusals."""

import json

import pytest

from helpers import RECIPE, ROOT, local_tasks, make_adapter, one_error_line
from lora_llama.cli import main

pytest.importorskip("lm_eval")


def chatterbot_mc_rows() -> list[dict]:
    """tasks/chatterbot's rows: the default recipe's held-out questions, each with its answer among three others."""
    import random

    from lora_llama.data.loading import load_records, split
    from lora_llama.recipe.schema import load_recipe

    recipe = load_recipe(RECIPE)
    _, val = split(load_records("chatterbot-corpus"), recipe.data.val_size, recipe.train.seed)
    qa = [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in val]
    rng, rows = random.Random(0), []
    for q, a in qa:
        others = list(dict.fromkeys(other for _, other in qa if other != a))
        choices = [*rng.sample(others, 3), a]
        rng.shuffle(choices)
        rows.append({"question": q, "choices": choices, "answer": choices.index(a)})
    return rows


def test_the_shipped_chatterbot_task_holds_the_default_recipes_held_out_questions(smollm2):
    shipped = (ROOT / "tasks" / "chatterbot" / "chatterbot_mc.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in shipped] == chatterbot_mc_rows(), "regenerate: see chatterbot_mc_rows"


@pytest.fixture(scope="module")
def setup(tiny_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("harness")
    return tiny_ckpt, make_adapter(tiny_ckpt, d / "adapter", std=0.3), local_tasks(d / "tasks")


def evaluate(lm, tasks_dir, names=("tiny_mc", "tiny_gen")):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=lm, tasks=list(names), task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True
    )


@pytest.mark.slow  # ~31 s: lm-eval's hf backend loads the model and adapter through peft
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


@pytest.mark.slow
def test_recipe_eval_tasks_run_before_and_after_and_reach_the_card(setup, chat_data, tmp_path, capsys):
    """eval.tasks on the base at step 0 and on the adapter at the end, each equal to lm-eval's hf backend (with peft
    for the adapter); in metrics.jsonl, the closing lines and the card's model-index; eval.prompts' answers logged."""
    from lm_eval.models.huggingface import HFLM

    base, _, tasks = setup
    run = tmp_path / "run"
    argv = ["train", RECIPE, f"model.source={base}", f"data.source={chat_data}", "data.packing=false"]
    argv += ["train.max_steps=2", "train.eval_every=1", "train.lr=1e-2", f"output.dir={run}"]
    argv += ["eval.tasks=[tiny_mc]", f"eval.include_path={tasks}", "eval.prompts=[what is up]"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tiny_mc/acc" in out and "(base model) ->" in out
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    acc = {r["step"]: r["lm_eval/tiny_mc/acc"] for r in lines if "lm_eval/tiny_mc/acc" in r}
    assert set(acc) == {0, 2}  # before and after (eval.every unset)
    for step, peft in ((0, None), (2, str(run / "adapter"))):
        hf = HFLM(pretrained=str(base), peft=peft, device="cpu", dtype="float32", batch_size=8)
        ref = evaluate(hf, tasks, ["tiny_mc"])
        assert acc[step] == ref["results"]["tiny_mc"]["acc,none"]
        assert json.loads((run / "eval" / f"lm-eval-step-{step}.json").read_text())["results"]["tiny_mc"]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 1, 2] and "what is up" in samples[-1]["samples"]
    assert main(["push", str(run), "--repo-id", "me/tiny", "--dry-run"]) == 0
    card = capsys.readouterr().out
    assert "model-index" in card and "tiny_mc" in card and "| tiny_mc | acc,none |" in card
