"""LoRA training on this CPU at four model sizes: lora-llama against transformers+peft, and against the rate torch's
own products reach at each model's shapes, in one run.

Random models with the shapes of SmolLM2-135M, SmolLM2-360M, Qwen2.5-0.5B and Llama-3.2-1B (bf16 checkpoints, the
SmolLM2 tokenizer), each trained for --steps steps on Shakespeare as rows of 512 tokens, 4 rows a step, LoRA r=16 on
all seven linears, AdamW, 2 threads: lora-llama through `lora-llama train` with `train.precision` from --precision
(auto by default: its pick on this CPU is named in the line) and `train.compile` from --compile (auto: eager blocks on
the CPU; true: each decoder block one compiled graph), transformers+peft in a plain loop over rows of the same shape
in the same precision (bf16 weights under autocast for bf16-mixed, as peft's users run it; float32 otherwise),
each in a process of its own. Tokens/s is the median of the steps after the first; peak memory is each process's VmHWM.
A peer whose process does not finish (killed for memory, most often) is recorded so, beside lora-llama's figures.

Beside each: the useful GFLOP/s of lora-llama's step over torch's GEMM rate at the model's shapes (bench/cpu_rate.py),
the rate measured before and after the size's runs (the better of the two: products on a shared machine drift).
`--default` adds the default recipe itself (recipes/smollm2-chat-cpu.yaml: the shipped SmolLM2-135M-Instruct,
packed chat rows of 256, r=8 on q, k, v, o) with its ratio to the GEMM rate. The loss, and with it the vocabulary
projection, runs at the tokens that predict a target only: each line records that share of the data's tokens
(`target_share`; a chat recipe's prompts take no loss), and the useful work and the head's rate count it.

    python -m bench.cpu [--sizes 135m,360m,0.5b,1b] [--steps 5] [--default] [--precision auto|fp32|bf16-mixed]
                        [--compile auto|true|false]

`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python -m bench.cpu ...` measures this machine as a CPU with AVX2
only (neither oneDNN nor aten's kernels use more; `precision: auto` then picks fp32); the line records the caps.
Run it alone: it measures the machine (all four sizes: about 25 minutes on 2 cores with
AVX512_BF16, 45 on 2 AVX2-only cores in fp32 with --steps 4)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import CLI_WITH_PEAK, ROOT, SMOLLM2_SHAPES, cpu_line, record, scratch_dir
from bench.cpu_rate import TARGET_NAMES, gemm_rate, useful_flops

SIZES = {  # name: (model_type, config.json shapes)
    "135m": ("llama", SMOLLM2_SHAPES),
    "360m": (
        "llama",
        dict(
            SMOLLM2_SHAPES,
            hidden_size=960,
            intermediate_size=2560,
            num_hidden_layers=32,
            num_attention_heads=15,
            num_key_value_heads=5,
        ),
    ),
    "0.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            max_position_embeddings=4096,
        ),
    ),
    "1b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            max_position_embeddings=4096,
        ),
    ),
}
SEQ, ROWS, R = 512, 4, 16


def checkpoint(folder: Path, size: str) -> Path:
    """A random bf16 checkpoint of the size's shapes, with the SmolLM2 tokenizer (its ids fit every vocabulary)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lora_llama import load_tokenizer

    model_type, shapes = SIZES[size]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shapes), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
    return folder


def run(cmd: list[str], must: bool = True) -> subprocess.CompletedProcess:
    """cmd on 2 threads, offline; a failure ends the benchmark unless not `must` (the caller reads returncode)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode and must:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return done


def ours(recipe: str, overrides: list[str], out: Path, skip: int, precision: str, compile_: str) -> dict:
    """`lora-llama train` on a recipe: tokens/s (median of the logged steps after `skip`), peak MB, precision."""
    args = [
        "train",
        recipe,
        *overrides,
        f"train.precision={precision}",
        f"train.compile={compile_}",
        f"output.dir={out}",
        "train.eval_every=100000",
        "train.save_every=100000",
    ]
    done = run([sys.executable, "-c", CLI_WITH_PEAK, *args, "--force"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    said = (done.stdout + done.stderr).splitlines()
    precision = next(line for line in said if "; precision " in line).split("; precision ")[1]
    return {
        "tokens_per_s": round(
            statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > skip), 1
        ),
        "peak_mb": round(int(done.stdout.split("PEAK_KB")[1].split()[0]) / 1024),
        "precision": precision.split()[0],
    }


def peer(folder: Path, precision: str, steps: int) -> dict:
    """transformers+peft's tokens/s and peak MB, or {"failed": why} where its process did not finish: a peer that
    runs out of memory where lora-llama trains is a result, and the row keeps lora-llama's figures."""
    done = run(
        [sys.executable, "-m", "bench.cpu", "--worker", str(folder), "--precision", precision, "--steps", str(steps)],
        must=False,
    )
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    if done.returncode == -signal.SIGKILL:  # what the kernel's out-of-memory killer sends
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        return {"failed": f"killed (SIGKILL: out of memory, {total:.0f} GB machine)"}
    return {"failed": (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:200]}


def peer_worker(folder: str, precision: str, steps: int) -> None:
    """transformers + peft, the way its users train: bf16 weights under autocast for bf16-mixed."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    bf16 = precision == "bf16-mixed"
    base = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16 if bf16 else torch.float32, attn_implementation="sdpa"
    )
    targets = [f"{t}_proj" for t in TARGET_NAMES]
    model = get_peft_model(base, LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=0.0, target_modules=targets))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        ids = torch.randint(3, 49152, (ROWS, SEQ), generator=g)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    hwm = int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])
    print(json.dumps({"tokens_per_s": round(ROWS * SEQ / statistics.median(times[1:]), 1), "peak_mb": hwm // 1024}))


def rate(cfg: dict, rows: int, precision: str, share: float) -> dict:
    return gemm_rate(cfg, rows, torch.bfloat16 if precision == "bf16-mixed" else torch.float32, target_share=share)


def target_share(recipe: str, overrides: list[str]) -> float:
    """The share of a recipe's training tokens (padding not counted) that predict a target, from its examples as
    `lora-llama train` builds them."""
    from lora_llama.data.sft import build_examples
    from lora_llama.data.templates import use_chat_template
    from lora_llama.labels import target_mask
    from lora_llama.loading.models import load_tokenizer, model_source
    from lora_llama.recipe.schema import load_recipe

    r = load_recipe(ROOT / recipe, overrides)
    tok = use_chat_template(load_tokenizer(model_source(r.model.source)), r.data.chat_template)
    train, _ = build_examples(r.data, tok, r.train.seed, log=lambda *_: None)
    segments = (torch.tensor([e["segment_ids"]]) if "segment_ids" in e else None for e in train)
    targets = sum(int(target_mask(torch.tensor([e["labels"]]), s).sum()) for e, s in zip(train, segments))
    return targets / sum(len(e["input_ids"]) for e in train)


def best(a: dict, b: dict) -> dict:
    """The better of two measurements of the rate, whole (its layers' and head's figures with it)."""
    return a if a["model"] >= b["model"] else b


def one_size(size: str, tmp: Path, steps: int, precision: str, compile_: str) -> dict:
    cfg = SIZES[size][1]
    folder = checkpoint(tmp / size, size)
    overrides = [
        f"model.source={folder}",
        f"data.max_seq_len={SEQ}",
        f"train.batch_size={ROWS}",
        "data.val_size=0",
        f"train.max_steps={steps}",
        f"lora.r={R}",
        f"lora.alpha={2 * R}",
        f"lora.targets=[{','.join(TARGET_NAMES)}]",
    ]
    recipe = "recipes/smollm2-shakespeare-cpu.yaml"
    mine = ours(recipe, overrides, tmp / f"run-{size}", skip=1, precision=precision, compile_=compile_)
    share = target_share(recipe, overrides)
    before = rate(cfg, ROWS * SEQ, mine["precision"], share)
    theirs = peer(folder, mine["precision"], steps)
    gemm = best(before, rate(cfg, ROWS * SEQ, mine["precision"], share))
    return figures(size, mine, theirs, gemm, share, useful_flops(cfg, SEQ, R, TARGET_NAMES, target_share=share))


def figures(size: str, mine: dict, theirs: dict | None, gemm: dict, share: float, flops: float) -> dict:
    useful = mine["tokens_per_s"] * flops / 1e9
    out = {
        "size": size,
        "precision": mine["precision"],
        "lora_llama": {k: mine[k] for k in ("tokens_per_s", "peak_mb")},
        "target_share": round(share, 3),
        "useful_gflops": round(useful),
        "gemm_gflops": gemm,
        "gemm_ratio": round(useful / gemm["model"], 2),
        "hours_per_10m_tokens": round(1e7 / mine["tokens_per_s"] / 3600, 1),
    }
    if theirs:
        out["peer"] = theirs
    if theirs and "failed" not in theirs:
        out["tokens_per_s_ratio"] = round(mine["tokens_per_s"] / theirs["tokens_per_s"], 2)
        out["memory_ratio"] = round(mine["peak_mb"] / theirs["peak_mb"], 2)
    return out


def default_recipe(tmp: Path, precision: str, compile_: str) -> dict:
    """The default recipe as shipped, 12 steps, its tokens/s past the first two (the compiled loops' build)."""
    recipe = "recipes/smollm2-chat-cpu.yaml"
    mine = ours(recipe, ["train.max_steps=12"], tmp / "run-default", skip=2, precision=precision, compile_=compile_)
    cfg, rows, share = SIZES["135m"][1], 4 * 256, target_share(recipe, [])
    gemm = best(rate(cfg, rows, mine["precision"], share), rate(cfg, rows, mine["precision"], share))
    flops = useful_flops(cfg, 256, 8, ("q", "k", "v", "o"), packed=True, target_share=share)
    return figures("default recipe", mine, None, gemm, share, flops)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help="of " + ", ".join(SIZES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--default", action="store_true", help="also the default recipe's ratio to the GEMM rate")
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16-mixed"), help="train.precision")
    ap.add_argument("--compile", default="auto", choices=("auto", "true", "false"), help="train.compile")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return peer_worker(a.worker, a.precision, a.steps)
    torch.set_num_threads(2)
    print(cpu_line(), flush=True)
    tmp = scratch_dir("lora-llama-cpu-bench-")
    rows = [default_recipe(tmp, a.precision, a.compile)] if a.default else []
    for size in filter(None, a.sizes.split(",")):  # --sizes '' with --default: the default recipe alone
        rows.append(one_size(size, tmp, a.steps, a.precision, a.compile))
        print(json.dumps(rows[-1]), flush=True)
    record("cpu", {"rows": rows})


if __name__ == "__main__":
    main()
