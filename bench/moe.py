"""LoRA on a mixture of experts, per library, in one run: lora-llama through `lora-llama train` (lora.targets
q, k, v, o and experts) against transformers + peft (target_modules q, k, v, o and target_parameters on the experts'
gate_up_proj and down_proj, peft's ParamWrapper) on the same random Qwen3-MoE checkpoint (8 experts, top 2, hidden
512, 4 layers), the same batches of the default recipe's data and the same AdamW; tokens/s is the median of the
steps after the first two, memory each process's peak resident memory. Each side runs in its own process; the
figures go to bench/results/moe.jsonl.
"""

import argparse
import json
import subprocess
import sys
from types import SimpleNamespace

from bench.common import ROOT, cpu_line, hf_step_rates, record, scratch_dir, status_mb

RECIPE = ROOT / "recipes" / "smollm2-chat-cpu.yaml"
SHAPES = dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_hidden_layers=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    norm_topk_prob=True,
)
ATTENTION = ["q", "k", "v", "o"]


def shapes(a) -> dict:
    """SHAPES with --experts, --top-k and --expert-dim where given (many small experts: Qwen3-MoE's proportions)."""
    given = {"num_experts": a.experts, "num_experts_per_tok": a.top_k, "moe_intermediate_size": a.expert_dim}
    return {**SHAPES, **{k: v for k, v in given.items() if v}}


def checkpoint(folder, a):
    from tests.helpers import build_checkpoint

    return build_checkpoint(folder, family="qwen3_moe", **shapes(a))


def settings(a, folder) -> list[str]:
    return [
        f"model.source={folder}",
        f"lora.targets=[{','.join(ATTENTION)},experts]",
        f"data.max_seq_len={a.seq}",
        f"train.batch_size={a.batch}",
    ]


def peft_worker(a) -> None:
    """Prints the tokens/s and peak memory of transformers + peft on the recipe's first batches."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_llama.recipe.schema import load_recipe

    torch.set_num_threads(2)
    r = load_recipe(str(RECIPE), settings(a, a.folder))
    tok = AutoTokenizer.from_pretrained(a.folder)
    model = AutoModelForCausalLM.from_pretrained(a.folder, dtype=torch.float32)
    config = LoraConfig(
        r=r.lora.r,
        lora_alpha=r.lora.alpha,
        target_modules=[f"{t}_proj" for t in ATTENTION],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    rate = hf_step_rates(get_peft_model(model, config), r, tok, a.steps)
    print(json.dumps({"tokens_per_s": rate, "peak_mb": status_mb("VmHWM")}))


def peft_run(a, folder) -> dict:
    argv = [sys.executable, "-m", "bench.moe", "--worker", str(folder), "--steps", str(a.steps)]
    argv += ["--seq", str(a.seq), "--batch", str(a.batch)]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"peft failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    from bench.quant import train

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128, help="data.max_seq_len")
    ap.add_argument("--batch", type=int, default=4, help="train.batch_size")
    ap.add_argument("--experts", type=int, help="num_experts (default 8)")
    ap.add_argument("--top-k", type=int, help="num_experts_per_tok (default 2)")
    ap.add_argument("--expert-dim", type=int, help="moe_intermediate_size (default 512)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.folder = a.worker
        return peft_worker(a)
    tmp = scratch_dir("lora-llama-moe-bench-")
    folder = checkpoint(tmp / "ckpt", a)
    ours = train(
        "none", tmp / "run", SimpleNamespace(steps=a.steps, precision="fp32", device="cpu"), settings(a, folder)
    )
    theirs = peft_run(a, folder)
    print(cpu_line())
    record(
        "moe",
        {
            "shapes": shapes(a),
            "tokens_per_s": {"lora-llama": ours["tokens_per_s"], "peft": theirs["tokens_per_s"]},
            "peak_mb": {"lora-llama": ours["peak_mb"], "peft": theirs["peak_mb"]},
            "speed_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "peak_ratio": ours["peak_mb"] / theirs["peak_mb"],
        },
    )


if __name__ == "__main__":
    main()
