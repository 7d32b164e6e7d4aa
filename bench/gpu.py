"""One GPU, one call: the LoRA / QLoRA training step of lora-llama against transformers+peft (SDPA) and
transformers+peft with liger-kernel's Llama kernels, at the sizes people fine-tune on one GPU.

Random Llama-shaped models in bf16 (each written once as an HF folder), the same rows of `seq` tokens on both sides
(random words, each row one document as lora-llama reads it: BOS, words, EOS), every token a target,
LoRA r=16 alpha=32 dropout 0 on all seven linears, AdamW, no activation checkpointing:

    8b       Llama-3.1-8B shapes, 2 x 2048, bf16 base
    8b-nf4   the same on an nf4 base; the peer is peft on bitsandbytes' 4-bit nf4 (bf16 compute)
    1b       Llama-3.2-1B shapes, 8 x 2048
    135m     SmolLM2-135M shapes, 4 x 512

lora-llama runs through `lora-llama train` on a recipe (bf16-mixed, train.compile auto); its tokens/s is the median of
the logged steps after the warm-up ones (the first compiles). The peers run a plain loop (autocast bf16, fused
AdamW), their fastest form. Every run is a process of its own, so each peak of GPU memory
(torch.cuda.max_memory_allocated) is that run's alone. MFU = model FLOPs a step / step time / the bf16 matmul peak
measured first on the same GPU, where model FLOPs count the forward and the input gradient of every frozen linear
and of lm_head (4 x tokens x parameters) and causal attention forward and backward (3 x 2 x B x layers x heads x
T^2 x head_dim); the LoRA products are left out (under 1%).

Each run writes one JSON line to `--out` (default $OUT, the device tool's folder that comes back) as it ends, so a
call cut short keeps what finished; each configuration then appends one line to bench/results/gpu.jsonl (and --out)
with its runs, its MFU and the ratios to each peer. `bench/gpu_wheels.sh` fetches the wheels a bare GPU image lacks;
`bench/gpu_call.sh` is the device call; docs/performance.md shows the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import LLAMA31_8B, QWEN3_MOE, ROOT, SMOLLM2_SHAPES, record, scratch_dir
from bench.gpu_workers import ours, peer, synchronize

LLAMA32_1B = dict(
    LLAMA31_8B,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    head_dim=64,
    tie_word_embeddings=True,
    rope_scaling=dict(LLAMA31_8B["rope_scaling"], factor=32.0),
)
SMOLLM2_135M = SMOLLM2_SHAPES  # the model bench.train_step measures on the CPU
# name: (model shapes, batch, seq, quantize, seconds a run may take: load, compile and steps)
# a smoke test of the bench itself on the CPU (`--device cpu --configs tiny`), not a measurement
TINY = dict(
    SMOLLM2_135M,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TINY_MOE = dict(QWEN3_MOE, **{k: TINY[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers")})
TINY_MOE.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
TINY_MOE.update(moe_intermediate_size=32)
CONFIGS = {
    "8b": (LLAMA31_8B, 2, 2048, None, 170),
    "8b-nf4": (LLAMA31_8B, 2, 2048, "nf4", 170),
    "1b": (LLAMA32_1B, 8, 2048, None, 100),
    "135m": (SMOLLM2_135M, 4, 512, None, 80),
    "tiny": (TINY, 2, 64, None, 300),
    "tiny-nf4": (TINY, 2, 64, "nf4", 300),
    "moe-int8": (QWEN3_MOE, 4, 2048, "int8", 200),  # int8 experts against peft's target_parameters on bf16 ones
    "tiny-moe-int8": (TINY_MOE, 2, 64, "int8", 300),
}
MODEL_OF = {c: c.removesuffix("-nf4").removesuffix("-int8") for c in CONFIGS}  # configurations sharing one model
PEERS = ("transformers+peft", "transformers+peft+liger")


# ---------------------------------------------------------------------------- the inputs


def random_model(folder: Path, shapes: dict, device: str) -> Path:
    """A random bf16 model of `shapes` (a LlamaForCausalLM, or the class of their model_type; std 0.02, norms 1)
    written as an HF folder in 5 GB shards, made on the GPU tensor by tensor (an 8B model in seconds, never whole in
    host memory twice), with a small byte-level BPE tokenizer whose ids fit the vocabulary."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers import make_tokenizer

    given = dict(shapes)
    config = AutoConfig.for_model(given.pop("model_type", "llama"), **given)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    shard, size, index = {}, 0, {}
    g = torch.Generator(device).manual_seed(0)
    names = [n for n in skeleton.state_dict() if not (shapes.get("tie_word_embeddings") and n == "lm_head.weight")]
    for i, name in enumerate(names):
        shape = skeleton.get_parameter(name).shape
        t = (
            torch.ones(shape, device=device)
            if name.endswith("norm.weight")
            else torch.randn(shape, device=device, generator=g).mul_(0.02)
        )
        shard[name] = t.to(torch.bfloat16).cpu()
        size += shard[name].numel() * 2
        if size > 5e9 or i == len(names) - 1:  # a shard written as soon as it is full
            file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(shard, folder / file, metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, file))
            shard, size = {}, 0
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def documents(path: Path, folder: Path, rows: int, seq: int) -> list[list[int]]:
    """`rows` documents of random words, each cut so that lora-llama reads it as one full row of `seq` tokens (BOS,
    the words, EOS: no short tail window), as a JSONL `text` file for lora-llama; and those rows' token ids for the
    peers, so both sides train on the same tokens."""
    import random

    from lora_llama import load_tokenizer
    from lora_llama.data.sft import Tokenize

    tok = load_tokenizer(folder)
    as_text_rows = Tokenize(tok, "text", seq).text
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "paris", "question", "world", "fine"]
    texts, ids = [], []
    for _ in range(rows):
        words_ids = tok(" ".join(rng.choice(words) for _ in range(seq * 2)), add_special_tokens=False)["input_ids"]
        for k in range(seq, seq - 8, -1):  # the longest prefix that reads back as exactly one full row
            text = tok.decode(words_ids[:k])
            windows = as_text_rows(text)
            if len(windows) == 1 and len(windows[0]["input_ids"]) == seq:
                break
        else:
            raise SystemExit(f"bench.gpu: no prefix of a document reads back as one row of {seq} tokens")
        texts.append(text)
        ids.append(windows[0]["input_ids"])
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return ids


def model_flops(shapes: dict, batch: int, seq: int) -> float:
    """FLOPs of a step's model work: forward and input gradient of the frozen linears and lm_head, causal attention
    forward and backward."""
    dim, layers, heads = shapes["hidden_size"], shapes["num_hidden_layers"], shapes["num_attention_heads"]
    head_dim = shapes.get("head_dim") or dim // heads
    kv = shapes["num_key_value_heads"] * head_dim
    if "num_experts" in shapes:  # a mixture: each token's top-k experts and the router
        mlp = shapes["num_experts_per_tok"] * 3 * dim * shapes["moe_intermediate_size"] + dim * shapes["num_experts"]
    else:
        mlp = 3 * dim * shapes["intermediate_size"]
    linears = layers * (dim * heads * head_dim * 2 + 2 * dim * kv + mlp)
    tokens = batch * seq
    attention = 3 * 2 * batch * layers * heads * seq * seq * head_dim  # causal: half of QKᵀ and PV's 4·T²·d
    return 4 * tokens * (linears + dim * shapes["vocab_size"]) + attention


# ---------------------------------------------------------------------------- the workers (one process each)


def matmul_peak(device: str) -> dict:
    """bf16 TFLOP/s of an n x n x n product on random data (n = 8192 on a GPU): the mean of 20 after 5 warm-ups."""
    import torch

    n = 8192 if device == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):
        a @ b
    synchronize(device)
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    synchronize(device)
    seconds = (time.perf_counter() - t) / 20
    return {
        "matmul_tflops": 2 * n**3 / seconds / 1e12,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "none (CPU smoke test)",
    }


# ---------------------------------------------------------------------------- the driver


def run_worker(kind: str, timeout: float, **kw) -> dict:
    cmd = [sys.executable, "-m", "bench.gpu", "--worker", kind, "--kw", json.dumps(kw)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if r.returncode:
        lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
        return {"error": " | ".join(lines[-3:])[-600:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def emit(out: Path | None, figures: dict, keep: bool) -> None:
    """A line into `out` at once; with `keep`, also into bench/results/gpu.jsonl (record)."""
    if keep:
        line = record("gpu", figures)
    else:
        line = figures
        print(json.dumps(line), flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "gpu.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def summary(config: str, runs: dict, peak: dict, common: dict) -> dict:
    """The configuration's line for bench/results: every run, MFU and the ratios to each peer. Its `args` name the
    configuration, so the report keeps the newest line of each."""
    ours_run, flops = runs.get("lora-llama", {}), common["model_flops_per_step"]
    s = {
        "args": ["--configs", config],
        "kind": "summary",
        **common,
        "matmul_tflops": peak.get("matmul_tflops"),
        "runs": runs,
    }
    if "tokens_per_s" in ours_run and peak.get("matmul_tflops"):
        s["mfu"] = float(f"{flops / ours_run['step_s'] / (peak['matmul_tflops'] * 1e12):.3g}")  # a tiny run's too
    for name, r in runs.items():
        if name != "lora-llama" and "tokens_per_s" in r and "tokens_per_s" in ours_run:
            s[f"tokens_per_s_vs_{name}"] = round(ours_run["tokens_per_s"] / r["tokens_per_s"], 3)
            s[f"gpu_peak_vs_{name}"] = round(ours_run["gpu_peak_mb"] / r["gpu_peak_mb"], 3)
    return s


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs", default="8b,8b-nf4,1b,135m", help=f"comma-separated, in order; of {', '.join(CONFIGS)}"
    )
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated; '' for lora-llama alone")
    ap.add_argument("--steps", type=int, default=6, help="measured steps a run")
    ap.add_argument("--warmup", type=int, default=3, help="steps before them (lora-llama's first compiles)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="a folder that also gets each line (default: $OUT)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the bench itself")
    ap.add_argument(
        "--budget",
        type=float,
        help="seconds for the whole bench: a run gets at most what is left, and once under MIN_RUN_S is left the "
        "rest are skipped, so every configuration's summary is written before a call's own limit cuts it",
    )
    ap.add_argument("--make-model", choices=list(MODEL_OF.values()), help="only write that random model (to --to)")
    ap.add_argument("--to", help="--make-model's folder")
    ap.add_argument("--tokenizer", help="--make-model: a tokenizer folder to save beside it (bench.grpo's chat one)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--kw", help=argparse.SUPPRESS)
    return ap.parse_args()


class Budget:
    """The seconds left of --budget (none: no limit), counted from the bench's start."""

    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else time.perf_counter() + seconds

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def spent(self) -> bool:
        return self.left() < MIN_RUN_S


MIN_RUN_S = 30  # a run given less could not load a model; it is skipped


def budgeted(budget: Budget, kind: str, timeout: float, **kw) -> dict:
    """run_worker within what is left of the budget; a run that cannot start is marked skipped."""
    if budget.spent():
        return {"error": "skipped: the bench's --budget is spent"}
    return run_worker(kind, min(timeout, budget.left()), **kw)


def run_config(a, config: str, folder: Path, tmp: Path, common: dict, timeout: float, out, budget: Budget) -> dict:
    """Ours, then each peer, on one configuration; every run's figures emitted as it ends."""
    name = MODEL_OF[config]
    shared = dict(batch=common["batch"], quantize=common["quantize"], steps=a.steps, warmup=a.warmup, device=a.device)
    ours = dict(folder=str(folder), data=str(tmp / f"{name}.jsonl"), out=str(tmp / f"run-{config}"), seq=common["seq"])
    runs = {"lora-llama": budgeted(budget, "ours", timeout, **ours, **shared)}
    emit(out, {"kind": "run", "library": "lora-llama", **common, **runs["lora-llama"]}, keep=False)
    for p in [p for p in a.peers.split(",") if p]:
        rows_file = str(tmp / f"{name}-rows.json")
        runs[p] = budgeted(
            budget, "peer", timeout, folder=str(folder), rows_file=rows_file, liger=p.endswith("liger"), **shared
        )
        emit(out, {"kind": "run", "library": p, **common, **runs[p]}, keep=False)
    return runs


def main():
    a = parse_args()
    if a.worker:
        fn = {"peak": matmul_peak, "peer": peer, "ours": ours}[a.worker]
        print(json.dumps(fn(**json.loads(a.kw))), flush=True)
        return
    if a.make_model:  # bench.grpo's random model of these shapes (bench/gpu_call.sh's grpo part)
        folder = random_model(Path(a.to), CONFIGS[a.make_model][0], a.device)
        if a.tokenizer:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(a.tokenizer).save_pretrained(folder)
        return
    configs = [c for c in a.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configuration {unknown[0]!r} (use {', '.join(CONFIGS)})")
    out = Path(a.out) if a.out else None
    tmp = scratch_dir("lora-llama-gpu-bench-")
    started, smoke = time.perf_counter(), a.device == "cpu"  # a smoke test records nothing in bench/results
    budget = Budget(a.budget)
    peak = run_worker("peak", 120, device=a.device)
    emit(out, {"kind": "matmul_peak", **peak}, keep=False)
    models = {}
    for config in configs:
        shapes, batch, seq, quantize, timeout = CONFIGS[config]
        name = MODEL_OF[config]
        if budget.spent():
            print(f"bench.gpu: {config} skipped, the --budget is spent", flush=True)
            continue
        if name not in models:
            folder = random_model(tmp / name, shapes, a.device)
            ids = documents(tmp / f"{name}.jsonl", folder, 2 * batch * (a.warmup + a.steps), seq)
            (tmp / f"{name}-rows.json").write_text(json.dumps(ids))
            models[name] = folder
        common = {
            "gpu": peak.get("gpu"),
            "config": config,
            "batch": batch,
            "seq": seq,
            "quantize": quantize,
            "steps": a.steps,
            "warmup": a.warmup,
            "model_flops_per_step": model_flops(shapes, batch, seq),
        }
        runs = run_config(a, config, models[name], tmp, common, timeout, out, budget)
        # bench/results keeps a configuration's line only where lora-llama ran: a run cut by the budget is no figure
        emit(out, summary(config, runs, peak, common), keep=not smoke and "tokens_per_s" in runs["lora-llama"])
    print(f"bench.gpu: {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
