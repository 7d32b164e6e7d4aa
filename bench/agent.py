"""The calculator agent of docs/agents.md, end to end through `lora-llama`: the base SmolLM2-135M-Instruct's
held-out accuracy and tool-call rate (the GRPO recipe's eval at step 0 on the base), then
`recipes/smollm2-tools-sft-cpu.yaml`, `lora-llama merge`, `recipes/smollm2-tools-grpo-cpu.yaml` twice from the
merged model, with `train.grpo.credit` trajectory and turn; each stage's held-out accuracy (greedy, the right number
in the last message: the `correct` reward's mean), share of answers that call the calculator, and minutes, and each
GRPO run's accuracy curve (an eval every 5 steps). The line goes to bench/results/agent.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from bench.common import ROOT, cpu_line, no_arguments, record, scratch_dir


def lora_llama(*args) -> float:
    """Minutes one command takes; its output is kept only when it fails."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lora_llama", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"lora-llama {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return (time.perf_counter() - start) / 60


ACCURACY = "eval_rewards/correct/mean"  # the recipe's `correct` reward: the right number in the last message
CREDITS = ("trajectory", "turn")


def evals(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if ACCURACY in r]


def recipe_credit(path: str) -> str:
    from lora_llama.recipe.schema import load_recipe

    return load_recipe(path, []).train.grpo.credit


def main():
    no_arguments(__doc__)
    tmp = scratch_dir("lora-llama-agent-")
    grpo, sft = "recipes/smollm2-tools-grpo-cpu.yaml", "recipes/smollm2-tools-sft-cpu.yaml"
    lora_llama("train", grpo, "model.source=smollm2-135m-instruct", "train.max_steps=1", f"output.dir={tmp / 'base'}")
    base = evals(tmp / "base")[0]
    sft_minutes = lora_llama("train", sft, f"output.dir={tmp / 'sft'}")
    merge_minutes = lora_llama(
        "merge", "--base", "smollm2-135m-instruct", "--adapter", str(tmp / "sft" / "adapter"), "--out", str(tmp / "m")
    )
    curves, minutes = {}, {}
    for credit in CREDITS:
        out = tmp / f"grpo-{credit}"
        where = (f"model.source={tmp / 'm'}", f"output.dir={out}", f"train.grpo.credit={credit}", "train.eval_every=5")
        minutes[credit] = lora_llama("train", grpo, *where)
        curves[credit] = evals(out)
    shipped = recipe_credit(grpo)
    after_sft, after_grpo = curves[shipped][0], curves[shipped][-1]
    stages = {"base": base, "sft": after_sft, "grpo": after_grpo}
    figures = {f"{k}_accuracy": v[ACCURACY] for k, v in stages.items()}
    figures |= {f"{k}_tool_calling": v["eval_tools/calling"] for k, v in stages.items()}
    figures |= {"sft_minutes": sft_minutes, "merge_minutes": merge_minutes, "grpo_minutes": minutes[shipped]}
    figures |= {f"grpo_{c}_minutes": minutes[c] for c in CREDITS}
    figures = {k: round(v, 3) for k, v in figures.items()}
    figures["credit"] = shipped
    figures["curves"] = {c: [[r["step"], round(r[ACCURACY], 3)] for r in curves[c]] for c in CREDITS}
    print(cpu_line())
    for k, v in stages.items():
        print(f"{k}: held-out accuracy {v[ACCURACY]:.3f}, answers calling the tool {v['eval_tools/calling']:.3f}")
    for c in CREDITS:
        print(f"credit {c}: " + ", ".join(f"step {step} {acc:.3f}" for step, acc in figures["curves"][c]))
    print(
        f"minutes: sft {sft_minutes:.1f}, merge {merge_minutes:.2f}, grpo "
        + ", ".join(f"{minutes[c]:.1f}" for c in CREDITS)
    )
    record("agent", figures)


if __name__ == "__main__":
    main()
