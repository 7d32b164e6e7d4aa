"""What DoRA costs over LoRA, per library, in one run: lora-llama through `lora-llama train` on the default recipe
(lora.use_dora false / true; median tokens/s of the logged steps after the first two), and transformers + peft on
the same model (the embedded SmolLM2's weights as lora-llama reads them), batches and adapter settings (LoraConfig
use_dora false / true; median step time). Each configuration runs in its own process; the figures go to
bench/results/dora.jsonl.
"""

import argparse
import json
import subprocess
import sys

from bench.common import ROOT, cpu_line, hf_step_rates, record, scratch_dir

RECIPE = ROOT / "recipes" / "smollm2-chat-cpu.yaml"


def peft_worker(use_dora: bool, steps: int) -> None:
    """Prints the tokens/s of each step of transformers + peft on the default recipe's first batches."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_llama.loading.models import resolve_source
    from lora_llama.model.config import LINEAR_NAMES
    from lora_llama.recipe.schema import load_recipe

    torch.set_num_threads(2)
    r = load_recipe(str(RECIPE))
    folder = resolve_source(r.model.source)  # the GGUF's weights as lora-llama reads them: an HF folder
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(
        model,
        LoraConfig(
            r=r.lora.r,
            lora_alpha=r.lora.alpha,
            use_dora=use_dora,
            target_modules=[LINEAR_NAMES[t] for t in r.lora.targets],
        ),
    )
    print(json.dumps({"tokens_per_s": hf_step_rates(model, r, tok, steps + 2)}))


def peft_run(use_dora: bool, steps: int) -> float:
    r = subprocess.run(
        [sys.executable, "-m", "bench.dora", "--worker", "dora" if use_dora else "lora", "--steps", str(steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        sys.exit(f"peft failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main():
    from bench.quant import train

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--precision", default="fp32", choices=["auto", "fp32", "bf16-mixed"])
    ap.add_argument("--worker", choices=["lora", "dora"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return peft_worker(a.worker == "dora", a.steps)
    a.device = "cpu"
    tmp = scratch_dir("lora-llama-dora-bench-")
    ours = {v: train("none", tmp / v, a, [f"lora.use_dora={v == 'dora'}"])["tokens_per_s"] for v in ("lora", "dora")}
    peer = {v: peft_run(v == "dora", a.steps) for v in ("lora", "dora")}
    print(cpu_line())
    print(
        f"default recipe, {a.steps} steps, {a.precision}: tokens/s (a DoRA step's cost = LoRA tokens/s / DoRA tokens/s)"
    )
    for name, runs in (("lora-llama", ours), ("transformers+peft", peer)):
        print(
            f"{name:<20} LoRA {runs['lora']:8.0f}  DoRA {runs['dora']:8.0f}  "
            f"DoRA step cost {runs['lora'] / runs['dora']:.2f}x"
        )
    record(
        "dora",
        {
            "tokens_per_s": {"lora_llama": ours, "peft": peer},
            "dora_step_cost": {
                "lora_llama": round(ours["lora"] / ours["dora"], 3),
                "peft": round(peer["lora"] / peer["dora"], 3),
            },
            "dora_vs_peft_dora_tokens_per_s": round(ours["dora"] / peer["dora"], 3),
        },
    )


if __name__ == "__main__":
    main()
