"""LoRA training step: lora-llama vs transformers + peft, same model, same batches, one run.

Random model with SmolLM2-135M shapes (30 layers, hidden 576, GQA 9:3, vocab 49152),
batch 4 x 512 tokens with completion-only labels on the second half, float32,
2 threads, LoRA r=16 on q,k,v,o,gate,up,down, dropout 0, AdamW. Each configuration
runs in its own subprocess so peak memories do not contaminate each other.
The last line printed is one JSON object with the ratios lora-llama / transformers+peft.
trl's SFTTrainer is not measured here (see the note in the README's benchmark section).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import random_checkpoint

TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
HF_TARGETS = [f"{t}_proj" for t in TARGETS]


def make_batches(path: Path, n: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(n):
        ids = torch.randint(3, 49152, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, : seq // 2] = -100  # completion-only: the prompt half is masked
        data.append((ids, labels))
    torch.save(data, path)


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, so the peak below is the steps' own, not the load's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(kind: str, ckpt: str, batches: str, checkpointing: bool, compile_: bool) -> dict:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    data = torch.load(batches)
    if kind == "lora-llama":
        from lora_llama import LoraSettings, apply_lora, load_model
        from lora_llama.loss import target_loss

        model = load_model(ckpt)
        apply_lora(model, LoraSettings(r=16, alpha=32, targets=TARGETS))
        model.gradient_checkpointing = checkpointing
        if compile_:  # what `train.compile: true` does; its cost shows in the first step
            for layer in model.model.layers:
                layer.compile()
        model.train()

        def loss_fn(ids, labels):
            s, n = target_loss(model, ids, labels)
            return s / n
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        base = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa")
        if checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS))
        model.train()

        def loss_fn(ids, labels):
            return model(input_ids=ids, labels=labels, use_cache=False).loss
    # both libraries map the checkpoint lazily: page the weights in now, so that what follows is the step's memory
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    before = status_mb("VmRSS")
    reset_peak()
    times, first_loss = [], None
    for i, (ids, labels) in enumerate(data):
        t = time.perf_counter()
        loss = loss_fn(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        if first_loss is None:
            first_loss = float(loss)
    steady = times[2:]  # the first two steps warm up allocators and the optimizer state
    median = statistics.median(steady)
    tokens = data[0][0].numel()
    peak = status_mb("VmHWM")
    return {"kind": kind, "median_step_s": median, "first_step_s": times[0], "tokens_per_s": tokens / median, "first_loss": first_loss,
            "peak_rss_mb": peak, "step_memory_mb": peak - before}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10, help="measured steps (after 2 warm-up steps)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--compile", action="store_true", help="torch.compile each lora-llama block (train.compile)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--batches", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.ckpt, a.batches, a.checkpointing, a.compile)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="lora-llama-train-bench-"))
    ckpt = random_checkpoint(tmp / "model")
    make_batches(tmp / "batches.pt", a.steps + 2, a.batch, a.seq)
    results = {}
    for kind in ("transformers+peft", "lora-llama"):
        cmd = [sys.executable, __file__, "--worker", kind, "--ckpt", str(ckpt), "--batches", str(tmp / "batches.pt")]
        cmd += ["--checkpointing"] if a.checkpointing else []
        cmd += ["--compile"] if a.compile else []
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if r.returncode != 0:
            sys.exit(f"{kind} failed:\n{r.stderr[-3000:]}")
        results[kind] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"batch {a.batch} x {a.seq}, float32, 2 threads, LoRA r=16 on {','.join(TARGETS)}"
          f"{', activation checkpointing' if a.checkpointing else ''}{', torch.compile (lora-llama)' if a.compile else ''}")
    print(f"{'':<20}{'step s':>9}{'1st step s':>11}{'tokens/s':>10}{'step MB':>9}{'peak MB':>9}{'first loss':>12}")
    for kind, r in results.items():
        print(f"{kind:<20}{r['median_step_s']:>9.2f}{r['first_step_s']:>11.2f}{r['tokens_per_s']:>10.0f}"
              f"{r['step_memory_mb']:>9.0f}{r['peak_rss_mb']:>9.0f}{r['first_loss']:>12.6f}")
    ours, ref = results["lora-llama"], results["transformers+peft"]
    print("trl SFTTrainer: not measured (its data collator and Trainer loop add work outside the step being compared)")
    print(json.dumps({"tokens_per_s_ratio": round(ours["tokens_per_s"] / ref["tokens_per_s"], 3),
                      "peak_memory_ratio": round(ours["step_memory_mb"] / ref["step_memory_mb"], 3),
                      "loss_diff": abs(ours["first_loss"] - ref["first_loss"])}))


if __name__ == "__main__":
    main()
