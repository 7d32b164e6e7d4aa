"""The trainer: overfitting, exact gradient accumulation, resume, NaN stop, bad recipes, the default recipe."""

import json

import pytest
import torch

import helpers
from helpers import ROOT
from lora_llama import load_adapter, load_model
from lora_llama.cli import main
from lora_llama.recipe.schema import load_recipe
from lora_llama.training.from_recipe import train_from_recipe
from lora_llama.training.trainer import Trainer

QA = [
    ("hi", "hello"),
    ("what is the capital", "paris"),
    ("to be", "or not to be"),
    ("the quick", "brown fox"),
    ("how are you", "i am fine"),
    ("the lazy", "dog"),
    ("hello", "world"),
    ("that is", "the question"),
]


def chat_file(path, pairs=QA):
    return helpers.chat_file(path, pairs)


def recipe(tiny_ckpt, data, out, *overrides):
    return load_recipe(
        None,
        [
            f"model.source={tiny_ckpt}",
            f"data.source={data}",
            f"output.dir={out}",
            "data.val_size=0",
            "train.warmup_steps=0",
            "train.precision=fp32",
            "model.device=cpu",
            *overrides,
        ],
    )  # exactness tests: CPU float32


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_overfits_eight_examples(tiny_ckpt, tmp_path):
    r = recipe(
        tiny_ckpt,
        chat_file(tmp_path / "d.jsonl"),
        tmp_path / "run",
        "train.max_steps=100",
        "train.batch_size=8",
        "train.lr=1e-2",
        "train.schedule=constant",
        "lora.r=16",
        "lora.alpha=32",
        "lora.targets=[q,k,v,o,gate,up,down,lm_head]",
        "train.save_every=1000",
        "train.eval_every=1000",
    )
    train_from_recipe(r, log=lambda *_: None)
    losses = [m["loss"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert len(losses) == 100
    assert min(losses) < 0.1 * losses[0]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000


def grads_of_first_step(tiny_ckpt, data, out, batch, accum):
    from lora_llama import apply_lora, load_tokenizer
    from lora_llama.data.sft import build_examples

    r = recipe(
        tiny_ckpt, data, out, f"train.batch_size={batch}", f"train.grad_accum={accum}", "train.max_grad_norm=null"
    )
    tok = load_tokenizer(tiny_ckpt)
    train, val = build_examples(r.data, tok, 0)
    model = load_model(tiny_ckpt)
    torch.manual_seed(0)
    apply_lora(model, r.lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    out.mkdir()
    trainer = Trainer(r, model, tok, train, val, out)
    seen = {}
    trainer.optimizer.step = lambda: seen.update(
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    )
    loss, _, _ = trainer.train_step()
    return loss, seen


def test_gradient_accumulation_equals_one_big_batch(tiny_ckpt, tmp_path):
    # four examples of clearly different lengths
    data = chat_file(
        tmp_path / "d.jsonl",
        [
            ("hi", "hello"),
            ("what is the capital of france", "paris is"),
            ("to be", "or not to be, that is the question"),
            ("the", "fox"),
        ],
    )
    loss_a, big = grads_of_first_step(tiny_ckpt, data, tmp_path / "a", batch=4, accum=1)
    loss_b, small = grads_of_first_step(tiny_ckpt, data, tmp_path / "b", batch=1, accum=4)
    assert abs(loss_a - loss_b) < 1e-5
    assert set(big) == set(small) and big
    for k in big:
        assert (big[k] - small[k]).abs().max() < 1e-5, k


@pytest.mark.parametrize("packing", [False, True])
def test_a_step_counts_the_tokens_of_its_examples_not_padding(tiny_ckpt, tmp_path, packing):
    from lora_llama import load_tokenizer
    from lora_llama.data.sft import build_examples

    data = chat_file(tmp_path / "d.jsonl", [("hi", "hello"), ("what is the capital of france", "paris is")])
    packed = ["data.packing=true", "data.max_seq_len=40"] if packing else []  # two rows of unequal length
    r = recipe(tiny_ckpt, data, tmp_path / "run", "train.batch_size=2", *packed)
    tok = load_tokenizer(tiny_ckpt)
    train, val = build_examples(r.data, tok, 0)
    (tmp_path / "run").mkdir()
    trainer = Trainer(r, load_model(tiny_ckpt), tok, train, val, tmp_path / "run")
    own = sum(len(e["input_ids"]) for e in train)
    assert len(train) == 2 and trainer.micro_batches[0]["input_ids"].numel() > own  # one batch, with padding
    assert trainer.train_step()[1] == own


def test_interrupt_and_resume_continue_exactly(tiny_ckpt, tmp_path, monkeypatch):
    data = chat_file(tmp_path / "d.jsonl")
    common = [
        "train.max_steps=20",
        "train.batch_size=2",
        "train.grad_accum=2",
        "lora.dropout=0.1",
        "train.save_every=4",
        "train.eval_every=1000",
        "train.lr=3e-3",
        "train.warmup_steps=3",
    ]
    train_from_recipe(recipe(tiny_ckpt, data, tmp_path / "full", *common), log=lambda *_: None)

    original = Trainer.train_step

    def stop_at_10(self):
        if self.step == 10:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", stop_at_10)
    with pytest.raises(KeyboardInterrupt):
        train_from_recipe(recipe(tiny_ckpt, data, tmp_path / "split", *common), log=lambda *_: None)
    assert (tmp_path / "split" / "checkpoints" / "step-10").is_dir()  # Ctrl-C saved the step it reached
    monkeypatch.setattr(Trainer, "train_step", original)
    train_from_recipe(recipe(tiny_ckpt, data, tmp_path / "split", *common), log=lambda *_: None)

    full = [m["loss"] for m in metrics(tmp_path / "full") if "loss" in m]
    resumed = [m["loss"] for m in metrics(tmp_path / "split") if "loss" in m]
    assert len(full) == len(resumed) == 20
    assert max(abs(a - b) for a, b in zip(full, resumed)) < 1e-6
    from safetensors.torch import load_file

    a = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "split" / "adapter" / "adapter_model.safetensors")
    assert max((a[k] - b[k]).abs().max() for k in a) < 1e-6
    assert len(list((tmp_path / "split" / "checkpoints").iterdir())) == 2  # keep_last


def test_nan_loss_stops_with_exit_2_and_keeps_last_checkpoint(tiny_ckpt, tmp_path, monkeypatch, capsys):
    import lora_llama.objectives.sft as objectives

    data = chat_file(tmp_path / "d.jsonl")
    real = objectives.target_loss
    calls = {"n": 0}

    def poisoned(*a, **k):
        loss, n = real(*a, **k)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 7 else loss), n

    monkeypatch.setattr(objectives, "target_loss", poisoned)
    out = tmp_path / "run"
    code = main(
        [
            "train",
            str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
            f"model.source={tiny_ckpt}",
            f"data.source={data}",
            f"output.dir={out}",
            "data.val_size=0",
            "train.max_steps=10",
            "train.save_every=5",
            "train.batch_size=2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "non-finite loss" in err and "step 7" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-5"]
    model = load_model(tiny_ckpt)
    load_adapter(model, out / "checkpoints" / "step-5" / "adapter")


BAD_RECIPES = {
    "unknown key": ("lora.alpah=16", "unknown recipe key 'lora.alpah' (did you mean 'lora.alpha'?)"),
    "unknown section": ("trian.lr=1", "unknown recipe key 'trian'"),
    "wrong type": ("train.batch_size=four", "train.batch_size"),
    "r=0": ("lora.r=0", "lora.r"),
    "negative lr": ("train.lr=-1", "train.lr"),
    "batch 0": ("train.batch_size=0", "train.batch_size"),
    "unknown format": ("data.format=xml", "data.format"),
    "unknown target": ("lora.targets=[q,qq]", "lora.targets"),
    "missing data file": ("data.source=/nonexistent/d.jsonl", "data source not found"),
    "bad override": ("train.max_steps", "must look like key.path=value"),
    "unknown model": ("model.source=/nonexistent/model", "model not found"),
    "missing layer": ("lora.layers=[7]", "LoRA layer 7 does not exist"),
}


@pytest.mark.parametrize("case", BAD_RECIPES)
def test_bad_recipes_one_line_exit_2_nothing_written(case, tiny_ckpt, tmp_path, capsys):
    override, message = BAD_RECIPES[case]
    data = chat_file(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    args = [
        "train",
        str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
        f"model.source={tiny_ckpt}",
        f"data.source={data}",
        f"output.dir={out}",
        "train.max_steps=1",
        override,
    ]
    assert main(args) == 2, case
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, (case, err)
    assert not out.exists()


def test_empty_dataset_and_missing_recipe(tmp_path, tiny_ckpt, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err
    code = main(
        [
            "train",
            str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
            f"model.source={tiny_ckpt}",
            f"data.source={empty}",
            f"output.dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_finished_run_is_not_overwritten_without_force(tiny_ckpt, tmp_path, capsys):
    data = chat_file(tmp_path / "d.jsonl")
    args = [
        "train",
        str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
        f"model.source={tiny_ckpt}",
        f"data.source={data}",
        f"output.dir={tmp_path / 'run'}",
        "train.max_steps=2",
        "data.val_size=0",
    ]
    assert main(args) == 0
    before = (tmp_path / "run" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert main(args) == 2 and "--force" in capsys.readouterr().err
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").read_bytes() == before
    assert main(args + ["--force", "lora.r=4"]) == 0


@pytest.mark.slow
def test_default_recipe_runs_three_steps(smollm2, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "cli.py"),
            "train",
            str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
            "train.max_steps=3",
            "train.batch_size=2",
            "data.max_examples=40",
            f"output.dir={out}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["steps"] == 3 and result["eval_loss"] > 0
    rows = metrics(out)
    assert "trainable (0.680%) on cpu" in r.stdout  # the device the model is on, not the setting "auto"
    start = [m["eval_loss"] for m in rows if m["step"] == 0]  # the base model's, before any step
    assert result["eval_loss_start"] == start[0]
    assert f"eval loss {start[0]:.4f} (base model) -> {result['eval_loss']:.4f} (adapter, step 3)" in r.stdout
    assert [m["step"] for m in rows if "loss" in m] == [1, 2, 3]
    assert {"step", "loss", "lr", "tokens_per_s"} <= set(rows[1])
    assert (out / "recipe.yaml").is_file() and (out / "loss.png").is_file()
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub id peft resolves


def test_shipped_recipes_validate():
    names = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    assert {
        "smollm2-chat-cpu.yaml",
        "smollm2-shakespeare-cpu.yaml",
        "llama2-7b-alpaca-int8.yaml",
        "llama3-8b-chat-int8.yaml",
        "llama3-8b-chat-nf4.yaml",
    } <= set(names)
    for name in names:
        r = load_recipe(str(ROOT / "recipes" / name))
        assert r.lora.r > 0 and r.output.dir.startswith("runs/")


def test_epochs_set_the_length_and_max_steps_caps_it():
    from lora_llama.training.schedule import total_steps

    r = load_recipe(None, ["train.epochs=2", "train.grad_accum=2"])
    assert total_steps(r.train, n_micro_batches=10) == 10
    capped = load_recipe(None, ["train.epochs=2", "train.max_steps=3"])
    assert total_steps(capped.train, n_micro_batches=10) == 3


def test_max_steps_null_lets_the_epochs_decide(tiny_ckpt, tmp_path):
    """`train.max_steps: null` with `train.epochs: 1`, as a recipe file says it: one pass over the 8 examples at
    batch 2 is 4 steps (the default of 300 steps is no cap)."""
    (tmp_path / "r.yaml").write_text("train:\n  epochs: 1\n  max_steps: null\n  batch_size: 2\n")
    data = chat_file(tmp_path / "d.jsonl")
    args = ["train", str(tmp_path / "r.yaml"), f"model.source={tiny_ckpt}", f"data.source={data}", "data.val_size=0"]
    assert main([*args, f"output.dir={tmp_path / 'run'}", "train.precision=fp32", "train.save_every=100"]) == 0
    assert [m["step"] for m in metrics(tmp_path / "run") if "loss" in m] == [1, 2, 3, 4]
