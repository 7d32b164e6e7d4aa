"""GRPO through the trainer and the CLI: held-out greedy reward rises, resume is exact, rewards load from files,
modules and built-ins, bad rewards and recipes stop with one line (exit 2) and keep the checkpoints."""

import json

import pytest
import torch

from lora_llama.cli import main
from lora_llama.errors import UserError
from lora_llama.objectives.grpo.rewards import extract_answer, format_reward, load_reward, score
from lora_llama.recipe.schema import load_recipe
from lora_llama.training.from_recipe import train_from_recipe

# rewards completions for token ids in the lower half of the tiny tokenizer's 300: learnable in a few steps
LOW_IDS = (
    "def low_ids(prompts, completions, completion_ids, **kw):\n"
    "    return [sum(t < 150 for t in c) / max(len(c), 1) for c in completion_ids]\n"
)


def prompt_file(path, n=24, extra=None):
    rows = [{"prompt": f"count to {i}", "number": i, **(extra or {})} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def grpo_recipe(ckpt, tmp_path, *overrides):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(LOW_IDS)
    return load_recipe(
        None,
        [
            f"model.source={ckpt}",
            f"data.source={prompt_file(tmp_path / 'p.jsonl')}",
            "data.format=prompt",
            "data.val_size=0.25",
            "data.max_seq_len=48",
            "train.objective=grpo",
            f"train.grpo.rewards=[{rewards}:low_ids]",
            "train.grpo.group_size=4",
            "train.grpo.max_new_tokens=12",
            "train.batch_size=3",
            "train.precision=fp32",
            "model.device=cpu",
            "train.warmup_steps=0",
            "train.lr=2e-2",
            "train.schedule=constant",
            "lora.targets=[q,v,lm_head]",
            "train.max_steps=12",
            "train.eval_every=12",
            f"output.dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


def metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("setting", [None, "model.quantize=nf4", "data.packing=true"])
def test_grpo_raises_the_held_out_greedy_reward(tiny_ckpt, tmp_path, setting):
    extra = [setting] if setting else []
    result = train_from_recipe(grpo_recipe(tiny_ckpt, tmp_path, *extra), log=lambda *_: None)
    print(f"eval reward {result['eval_reward_start']:.3f} -> {result['eval_reward']:.3f}")
    assert result["eval_reward"] > result["eval_reward_start"] + 0.2
    rows = [m for m in metrics(tmp_path / "run") if "loss" in m]
    rewards = [m["reward"] for m in rows]
    assert len(rows) == 12 and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards  # the sampled ones too
    for key in (
        "reward_std",
        "rewards/low_ids/mean",
        "completions/mean_length",
        "clip_ratio/region_mean",
        "tokens_per_s",
    ):
        assert key in rows[0], key
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_grpo_resume_between_iterations_continues_exactly(tiny_ckpt, tmp_path):
    """num_iterations 2 with a checkpoint at an odd step: the kept rollouts travel in the checkpoint."""
    from safetensors.torch import load_file

    common = ("train.grpo.num_iterations=2", "train.grpo.beta=0.05", "train.save_every=3", "train.max_steps=6")
    (tmp_path / "a").mkdir()
    full = grpo_recipe(tiny_ckpt, tmp_path / "a", *common, f"output.dir={tmp_path / 'full'}")
    train_from_recipe(full, log=lambda *_: None)
    (tmp_path / "b").mkdir()
    cut = grpo_recipe(tiny_ckpt, tmp_path / "b", *common[:3], "train.max_steps=6", f"output.dir={tmp_path / 'cut'}")
    import lora_llama.training.trainer as trainer

    original = trainer.Trainer.train_step

    def stop_at_3(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return original(self)

    trainer.Trainer.train_step = stop_at_3
    try:
        with pytest.raises(KeyboardInterrupt):
            train_from_recipe(cut, log=lambda *_: None)
    finally:
        trainer.Trainer.train_step = original
    train_from_recipe(cut, log=lambda *_: None)
    a, b = (load_file(tmp_path / r / "adapter" / "adapter_model.safetensors") for r in ("full", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    def losses(r):
        return [m["loss"] for m in metrics(tmp_path / r) if "loss" in m]

    assert losses("full") == losses("cut") and "kl" in metrics(tmp_path / "full")[1]


def test_rewards_load_from_files_modules_and_built_ins(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(LOW_IDS)
    assert load_reward(f"{f}:low_ids")[0] == "low_ids"
    assert load_reward("lora_llama.objectives.grpo.rewards:format_reward")[1] is format_reward
    assert load_reward("format")[1] is format_reward
    for spec, words in (
        (f"{tmp_path}/none.py:x", "no such file"),
        (f"{f}:missing", "no function 'missing'"),
        ("nomodule_xyz:f", "cannot import"),
        ("justaname", "use path/to/file.py:function"),
    ):
        with pytest.raises(UserError, match=words):
            load_reward(spec)


def test_built_in_rewards():
    good = "<think>2 and 2</think> <answer>4</answer>"
    assert format_reward(None, [good, "4", [{"role": "assistant", "content": good}]]) == [1.0, 0.0, 1.0]
    assert extract_answer("so <answer> 3 </answer> or <answer>4</answer>") == "4" and extract_answer(" 7 ") == "7"
    import reasoning_gym

    from lora_llama.objectives.grpo.rewards import reasoning_gym_reward

    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=0))
    right = [f"<answer>{e['answer']}</answer>" for e in entries]
    assert reasoning_gym_reward(None, right, entry=entries) == [1.0] * 3
    assert reasoning_gym_reward(None, ["no idea"] * 3, entry=entries) == [0.0] * 3


def _bad(values=None, raise_on=None):
    def fn(prompts, completions, **_):
        if raise_on is not None and raise_on in completions:
            raise ValueError("cannot parse")
        return values if values is not None else [1.0] * len(completions)

    return fn


@pytest.mark.parametrize(
    "fn,message",
    [
        (_bad(raise_on="b"), r"reward fn raised ValueError: cannot parse on row 1 \(prompt 'q1'\)"),
        (_bad(values=[1.0]), "reward fn returned 1 values for 3 completions"),
        (
            _bad(values=[1.0, "x", 2.0]),
            r"reward fn returned 'x' \(str\) for row 1 \(prompt 'q1'\): not a number or None",
        ),
    ],
)
def test_bad_rewards_name_the_function_and_the_row(fn, message):
    with pytest.raises(UserError, match=message):
        score({"fn": fn}, ["q0", "q1", "q2"], ["a", "b", "c"], {})


def test_none_is_not_applicable():
    table = score({"f": _bad(values=[1.0, None, 2])}, ["p"] * 3, ["a"] * 3, {})
    assert table[0, 0] == 1.0 and table[1, 0].isnan() and table[2, 0] == 2.0


def test_a_reward_that_raises_stops_the_run_with_exit_2_and_keeps_checkpoints(tiny_ckpt, tmp_path, capsys):
    rewards = tmp_path / "boom.py"
    rewards.write_text(
        "calls = []\ndef boom(prompts, completions, **kw):\n    calls.append(1)\n"
        "    if len(calls) > 2:\n        raise KeyError('answer')\n    return [0.5] * len(completions)\n"
    )
    r = grpo_recipe(tiny_ckpt, tmp_path)  # writes the prompt file
    (tmp_path / "r.yaml").write_text("")
    overrides = [
        f"model.source={tiny_ckpt}",
        f"data.source={tmp_path / 'p.jsonl'}",
        "data.format=prompt",
        "train.objective=grpo",
        f"train.grpo.rewards=[{rewards}:boom]",
        "train.grpo.group_size=2",
        "train.grpo.max_new_tokens=4",
        "train.batch_size=2",
        "data.val_size=0",
        "train.max_steps=4",
        "train.save_every=2",
        "train.precision=fp32",
        f"output.dir={r.output.dir}",
    ]
    code = main(["train", str(tmp_path / "r.yaml"), *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(
        "lora-llama train: error: reward boom raised KeyError: 'answer' on row 0"
    ), err
    assert (tmp_path / "run" / "checkpoints" / "step-2").is_dir()


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["train.objective=grpo", "data.format=chat"], "train.objective grpo reads data.format prompt"),
        (["data.format=prompt"], r"not prompt \(which train.objective grpo reads\)"),
        (
            [
                "train.objective=grpo",
                "data.format=prompt",
                "train.grpo.rewards=[format]",
                "train.grpo.reward_weights=[1, 2]",
            ],
            "reward_weights has 2 values for 1 rewards",
        ),
        (["train.objective=grpo", "data.format=prompt", "train.grpo.group_size=1"], "train.grpo.group_size"),
        (["train.objective=grpo", "data.format=prompt", "train.grpo.loss_type=ppo"], "train.grpo.loss_type"),
    ],
)
def test_grpo_recipe_errors_are_one_line(overrides, words):
    with pytest.raises(UserError, match=words):
        load_recipe(None, overrides)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_grpo_on_two_processes_equals_one(tiny_ckpt, tmp_path, strategy):
    """Each process samples its own prompts' groups; advantages and the dapo token count are global. Under fsdp
    every rank decodes until the last rank's rows are done (each forward gathers weights from both)."""
    from test_distributed import assert_same_runs, torchrun

    base = grpo_recipe(tiny_ckpt, tmp_path)  # writes the prompt and reward files
    rewards = tmp_path / "rewards.py"
    common = [
        f"model.source={tiny_ckpt}",
        f"data.source={tmp_path / 'p.jsonl'}",
        "data.format=prompt",
        "data.val_size=0.25",
        "data.max_seq_len=48",
        "train.objective=grpo",
        f"train.grpo.rewards=[{rewards}:low_ids]",
        "train.grpo.group_size=4",
        "train.grpo.max_new_tokens=8",
        "train.grpo.beta=0.05",
        "train.grpo.scale_rewards=batch",
        "train.precision=fp32",
        "model.device=cpu",
        "train.warmup_steps=0",
        "train.lr=1e-3",
        "train.max_steps=3",
        "train.eval_every=3",
        "train.save_every=1",  # a checkpoint before the last step: the adapters' update is measured from it
        "lora.targets=[q,v,lm_head]" if strategy == "ddp" else "lora.targets=[q,v,o]",
        "train.collective_timeout_s=60",
        f"train.distributed={strategy}",
    ]
    recipe = str(tmp_path / "empty.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert base.train.objective == "grpo"
    assert main(["train", recipe, *common, "train.batch_size=2", f"output.dir={tmp_path / 'one'}"]) == 0
    code, out, err = torchrun(["train", recipe, *common, "train.batch_size=1", f"output.dir={tmp_path / 'two'}"])
    assert code == 0, err[-3000:]
    assert_same_runs(tmp_path / "one", tmp_path / "two", ("loss", "reward", "reward_std", "kl", "eval_reward"))
