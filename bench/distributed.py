"""Training on 1 process x 2 threads vs 2 processes x 1 thread (gloo): lora-llama (ddp, fsdp) beside
transformers+peft (under torchrun DDP), same global batch, one run.

Random model with SmolLM2-135M shapes, the SmolLM2 tokenizer, Shakespeare as 512-token rows (text
format), global batch 4 rows, LoRA r=16 on q,k,v,o,gate,up,down, float32. lora-llama runs through
`lora-llama train` (what users run); its tokens/s is the median over the logged steps after the first.
The peer is transformers' LlamaForCausalLM + peft in a plain loop (DistributedDataParallel when on 2
processes) over random rows of the same shape. The figures go to bench/results/distributed.jsonl.

--model llama-1.1b: each rank's peak resident memory (VmHWM) and tokens/s for 1 process and 2 processes x
ddp / fsdp, on a random Llama-shaped 1.1B model in float32 500 MB shards, unquantized and with int8 / nf4
bases: the default recipe's data as rows of --seq tokens, global batch 2, --steps steps, no eval. The figures
go to bench/results/distributed.jsonl too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import ROOT, cpu_line, llama_1b_checkpoint, random_checkpoint, record, scratch_dir

TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def peer_worker(ckpt: str, steps: int, per_rank: int, seq: int) -> None:
    """transformers + peft; DDP when torchrun started us on several processes."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa"),
        LoraConfig(r=16, lora_alpha=32, target_modules=[f"{t}_proj" for t in TARGETS]),
    )
    model.train()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    times = []
    for _ in range(steps):
        ids = torch.randint(3, 49152, (per_rank, seq), generator=g)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    if os.environ.get("RANK", "0") == "0":
        print("PEER", per_rank * world * seq / statistics.median(times[1:]), flush=True)
    if world > 1:
        dist.destroy_process_group()


def run(cmd: list[str], threads: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return r.stdout


def ours(folder: Path, out: Path, nproc: int, strategy: str, steps: int, seq: int) -> float:
    """tokens/s of `lora-llama train` from its metrics.jsonl (median of the steps after the first)."""
    cmd = [
        sys.executable,
        "-m",
        "lora_llama",
        "train",
        str(ROOT / "recipes" / "smollm2-shakespeare-cpu.yaml"),
        f"model.source={folder}",
        f"output.dir={out}",
        f"train.max_steps={steps}",
        f"data.max_seq_len={seq}",
        f"train.batch_size={4 // nproc}",
        "train.grad_accum=1",
        "data.val_size=0",
        "train.save_every=100000",
        "train.eval_every=100000",
        "lora.r=16",
        "lora.alpha=32",
        f"lora.targets=[{','.join(TARGETS)}]",
        f"train.distributed={strategy}",
        "--force",
    ] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    run(cmd, threads=2 if nproc == 1 else 1)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 1)


def peer(folder: Path, nproc: int, steps: int, seq: int) -> float:
    worker = [
        "-m",
        "bench.distributed",
        "--worker",
        str(folder),
        "--steps",
        str(steps),
        "--seq",
        str(seq),
        "--per-rank",
        str(4 // nproc),
    ]
    cmd = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + worker
        if nproc > 1
        else [sys.executable] + worker
    )
    out = run(cmd, threads=2 if nproc == 1 else 1)
    return float(out.split("PEER ")[1].split()[0])


# each worker runs the CLI and then reports its rank's peak resident memory: VmHWM, its own (ru_maxrss would
# start from the RSS of the process that forked it: Linux keeps it across fork and exec)
PEAK_WRAPPER = (
    "import os, sys\nfrom lora_llama.cli import main\ncode = main(sys.argv[1:])\n"
    "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]\n"
    "print('PEAK_KB', os.environ.get('RANK', '0'), hwm, flush=True)\nsys.exit(code)\n"
)


def memory_run(folder: Path, out: Path, nproc: int, strategy: str, quantize: str, a) -> dict:
    """Per-rank peak MB (the largest rank's) and tokens/s of one `lora-llama train` run on the 1.1B model."""
    wrapper = out.parent / "peak_wrapper.py"
    wrapper.write_text(PEAK_WRAPPER)
    argv = [
        "train",
        str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
        f"model.source={folder}",
        f"output.dir={out}",
        f"train.max_steps={a.steps}",
        f"data.max_seq_len={a.seq}",
        f"train.batch_size={2 // nproc}",
        "train.grad_accum=1",
        "data.val_size=0",
        "train.eval_every=100000",
        "train.save_every=100000",
        "train.precision=fp32",
        f"train.distributed={strategy}",
        "--force",
    ]
    argv += [f"model.quantize={quantize}"] if quantize != "none" else []
    cmd = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(wrapper)]
        if nproc > 1
        else [sys.executable, str(wrapper)]
    ) + argv
    stdout = run(cmd, threads=2 if nproc == 1 else 1)
    peaks = [int(line.split()[2]) / 1024 for line in stdout.splitlines() if line.startswith("PEAK_KB")]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "peak_mb_per_rank": round(max(peaks)),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r), 1),
    }


def memory_table(a) -> None:
    print(cpu_line())
    tmp = scratch_dir("lora-llama-dist-mem-")
    folder = llama_1b_checkpoint(tmp / "llama-1.1b", dtype=torch.float32)
    table = {}
    for quantize in a.quantize:
        for name, nproc, strategy in [("1 process", 1, "ddp"), ("2 x ddp", 2, "ddp"), ("2 x fsdp", 2, "fsdp")]:
            r = memory_run(folder, tmp / f"run-{quantize}-{nproc}-{strategy}", nproc, strategy, quantize, a)
            r["peak_vs_one_process"] = round(
                r["peak_mb_per_rank"] / table.get((quantize, "1 process"), r)["peak_mb_per_rank"], 3
            )
            table[(quantize, name)] = r
            print(
                f"{quantize:6s} {name:10s} peak {r['peak_mb_per_rank']:6d} MB per rank "
                f"({r['peak_vs_one_process']:.2f}x one process)  {r['tokens_per_s']:7.1f} tokens/s",
                flush=True,
            )
    record(
        "distributed",
        {
            "model": "random Llama 1.1B, float32",
            "seq": a.seq,
            "steps": a.steps,
            "runs": {f"{q} {n}": r for (q, n), r in table.items()},
        },
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--model", default="smollm2-shapes", choices=["smollm2-shapes", "llama-1.1b"])
    ap.add_argument("--quantize", nargs="+", default=["none", "int8", "nf4"], help="with --model llama-1.1b")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--per-rank", type=int, default=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return peer_worker(a.worker, a.steps, a.per_rank, a.seq)
    if a.model == "llama-1.1b":
        return memory_table(a)
    from lora_llama import load_tokenizer

    print(cpu_line())
    tmp = scratch_dir("lora-llama-dist-bench-")
    folder = random_checkpoint(tmp / "model")
    load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
    table = {}
    for name, nproc, strategy in [
        ("1 process x 2 threads", 1, "ddp"),
        ("2 processes x 1 thread, ddp", 2, "ddp"),
        ("2 processes x 1 thread, fsdp", 2, "fsdp"),
    ]:
        mine = ours(folder, tmp / f"run-{nproc}-{strategy}", nproc, strategy, a.steps, a.seq)
        theirs = table.get(nproc, {}).get("peer") or peer(folder, nproc, a.steps, a.seq)
        table[nproc] = {"peer": theirs}
        table[name] = {"lora_llama": mine, "peer": theirs, "ratio": mine / theirs}
        print(
            f"{name:32s} lora-llama {mine:7.1f} tok/s   transformers+peft (DDP) {theirs:7.1f} tok/s   "
            f"ratio {mine / theirs:.2f}",
            flush=True,
        )
    rows = {k: v for k, v in table.items() if isinstance(k, str)}
    one = rows["1 process x 2 threads"]["lora_llama"]
    record(
        "distributed",
        {
            "tokens_per_s": {
                k: {"lora_llama": round(v["lora_llama"], 1), "peer": round(v["peer"], 1)} for k, v in rows.items()
            },
            "ratios_vs_peer": {k: round(v["ratio"], 3) for k, v in rows.items()},
            "two_processes_vs_one": {k: round(v["lora_llama"] / one, 3) for k, v in rows.items()},
        },
    )


if __name__ == "__main__":
    main()
