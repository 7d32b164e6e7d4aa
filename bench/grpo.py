"""GRPO through `lora-llama train` on recipes/smollm2-grpo-cpu.yaml's settings, and trl's GRPOTrainer with peft on
the same model, prompts, reward and settings, each in its own process in one run: seconds per step (sampling
and the update), completions/s, completion tokens/s and peak resident memory (VmHWM; on a GPU also the
peak of CUDA memory). The first step (compilation, caches) is left out of the medians. On a GPU it first runs
bench.decode (GRPO's sampling alone at SmolLM2-135M and Llama-3.2-1B shapes: completion tokens/s, a decode step
against its bandwidth floor) and keeps its figures beside the step's. With --tools MODEL both run the calculator
agent's GRPO (docs/agents.md): completions over several turns, the calculator answering between them (trl's
tools loop against lora-llama's turns over a kept cache).
The figures go to bench/results/grpo.jsonl.
"""

import argparse
import json
import statistics
import subprocess
import sys

from bench.common import ROOT, cpu_line, record, scratch_dir

RECIPE = ROOT / "recipes" / "smollm2-grpo-cpu.yaml"
# --tools: the calculator agent's GRPO (recipes/smollm2-tools-grpo-cpu.yaml) on both libraries, completions over
# several turns with the calculator answering between them
TOOLS = [
    "data.source=calculator-questions",
    "data.chat_template=chatml-tools",
    "data.system_prompt=null",
    "data.max_seq_len=384",
    "train.grpo.tools=[recipes/tools/calculator.py:calculate]",
    "train.grpo.rewards=[recipes/tools/calculator.py:correct]",
    "train.grpo.max_new_tokens=96",
    "train.grpo.max_tool_calling_iterations=2",
]
OURS = """
import json, sys, time, torch
from bench.common import status_mb
from lora_llama.training import trainer
from lora_llama.cli import main
times, original = [], trainer.Trainer.train_step
def timed(self):
    start = time.perf_counter()
    out = original(self)
    times.append(time.perf_counter() - start)
    return out
trainer.Trainer.train_step = timed
code = main(sys.argv[1:])
rows = [json.loads(l) for l in open(sys.argv[-2].split("=", 1)[1] + "/metrics.jsonl") if '"loss"' in l]
print(json.dumps({"step_s": times, "mean_length": [r["completions/mean_length"] for r in rows],
                  "peak_mb": status_mb("VmHWM"),
                  "gpu_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0}))
sys.exit(code)
"""


def overrides(a) -> list[str]:
    """The recipe as both libraries run it: --source and --data (prompts, scored by the format reward) replace the
    model and the task (a GPU machine without the embedded model or reasoning-gym)."""
    extra = [f"model.source={a.source}"] if a.source else []
    extra += [f"data.source={a.data}", "train.grpo.rewards=[format]"] if a.data else []
    extra += [*TOOLS, f"model.source={a.tools}"] if a.tools else []
    return extra + ["data.val_size=0", f"model.device={a.device}", *a.overrides]


def ours(a, out) -> dict:
    args = [
        "train",
        str(RECIPE),
        f"train.max_steps={a.steps}",
        "train.eval_every=100000",
        "train.save_every=100000",
        f"train.precision={a.precision}",
        *overrides(a),
        f"output.dir={out}",
        "--force",
    ]
    r = subprocess.run([sys.executable, "-c", OURS, *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"lora-llama failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def module_output(args: list[str], name: str) -> list[str] | None:
    """The stdout lines of `python -m ARGS` run from the repository root, or None, said in one line, when it fails."""
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    if r.returncode or not lines:
        print(f"{name} could not run: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    return lines


def peer(a) -> dict | None:
    args = ["bench.grpo_trl", "--steps", str(a.steps), "--precision", a.precision, "--device", a.device]
    lines = module_output([*args, *overrides(a)], "trl GRPOTrainer")
    return json.loads(lines[-1]) if lines else None


def decoding(a) -> dict | None:
    """bench.decode's runs on this device, in a process of its own (its own line goes to decode.jsonl too)."""
    lines = module_output(["bench.decode", "--device", a.device], "bench.decode")
    if not lines:
        return None
    print("\n".join(lines[:-1]), flush=True)  # its figures as it prints them; the last line is its record
    return json.loads(lines[-1])["runs"]


def figures(run: dict, completions: int) -> dict:
    steps = run["step_s"][1:] or run["step_s"]
    lengths = run["mean_length"][1:] or run["mean_length"]
    step_s = statistics.median(steps)
    return {
        "step_s": round(step_s, 3),
        "completions_per_s": round(completions / step_s, 2),
        "completion_tokens_per_s": round(statistics.mean(lengths) * completions / statistics.mean(steps), 1),
        "mean_length": round(statistics.mean(lengths), 1),
        "peak_mb": round(run["peak_mb"]),
        **({"gpu_peak_mb": round(run["gpu_peak_mb"])} if run.get("gpu_peak_mb") else {}),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--no-peer", action="store_true", help="lora-llama only")
    ap.add_argument("--source", help="another model.source (an HF folder with a chat tokenizer)")
    ap.add_argument("--data", help="a prompt JSONL instead of the reasoning-gym task (reward: format)")
    ap.add_argument(
        "--tools",
        metavar="MODEL",
        help="the calculator agent's multi-turn GRPO from MODEL, one that calls tools (docs/agents.md: the SFT "
        "recipe's merged model)",
    )
    ap.add_argument("overrides", nargs="*", help="more recipe overrides, for both libraries (key.path=value)")
    a = ap.parse_args()
    from lora_llama.recipe.schema import load_recipe

    t = load_recipe(str(RECIPE), TOOLS if a.tools else []).train
    completions = t.batch_size * t.grpo.group_size
    decoded = decoding(a) if a.device == "cuda" else None
    runs = {"lora-llama": figures(ours(a, scratch_dir("lora-llama-grpo-") / "run"), completions)}
    trl_run = None if a.no_peer else peer(a)
    if trl_run:
        runs["trl+peft"] = figures(trl_run, completions)
    print(cpu_line())
    print(
        f"GRPO, {t.batch_size} prompts x {t.grpo.group_size} completions of up to {t.grpo.max_new_tokens} tokens, "
        f"{a.precision} on {a.device}, {a.steps} steps (the first left out)"
    )
    print(f"{'':<12}{'step s':>8}{'compl/s':>9}{'tok/s':>8}{'mean len':>10}{'peak MB':>9}")
    for name, f in runs.items():
        print(
            f"{name:<12}{f['step_s']:>8.2f}{f['completions_per_s']:>9.2f}{f['completion_tokens_per_s']:>8.1f}"
            f"{f['mean_length']:>10.1f}{f['peak_mb']:>9}"
        )
    ratios = {}
    if "trl+peft" in runs:
        ours_f, trl_f, peak = runs["lora-llama"], runs["trl+peft"], "gpu_peak_mb" if a.device == "cuda" else "peak_mb"
        ratios = {
            "step_time_ratio": round(ours_f["step_s"] / trl_f["step_s"], 3),
            "peak_memory_ratio": round(ours_f[peak] / trl_f[peak], 3),
        }  # on a GPU, of GPU memory
    record("grpo", {"runs": runs, **ratios, **({"decoding": decoded} if decoded else {})})


if __name__ == "__main__":
    main()
