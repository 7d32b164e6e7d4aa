"""GRPO's sampling alone: `model/generate.sample_completions` through an adapted model (LoRA r=16 on all seven linears),
decoding with the growing cache (the CPU's path) and with the static one (on CUDA replayed as a CUDA graph), each
timed in one process on the same rows: completion tokens/s, a decode step's time, and that step against its
bandwidth floor (bytes of weights and cache a step reads over the device's copy bandwidth, measured first); and
`lora-llama generate`'s loop on one prompt, both paths (tokens/s).

Random models of SmolLM2-135M and Llama-3.2-1B shapes (bench.gpu's), bf16 on a GPU, float32 on the CPU; `rows`
completions (prompts x group) of `new` tokens from prompts of `prompt` tokens, no EOS, seeded sampling. A decode
step's time is the difference between runs of `new` tokens and of one, over new - 1. The figures go to
bench/results/decode.jsonl.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import cpu_line, record, scratch_dir
from bench.gpu import LLAMA32_1B, SMOLLM2_135M, random_model
from bench.gpu_workers import synchronize

MODELS = {"135m": SMOLLM2_135M, "1b": LLAMA32_1B}


def seconds(device: str, work) -> float:
    """Wall time of work() with the device's queue drained before and after."""
    synchronize(device)
    t = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - t


def copy_bandwidth(device: str) -> float:
    """Bytes read and written a second by a 1 GB device-to-device copy (the median of 5 after a warm-up)."""
    a = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    b = torch.empty_like(a)
    times = [seconds(device, lambda: b.copy_(a)) for _ in range(6)]
    return 2 * a.numel() * 4 / sorted(times[1:])[2]


def step_bytes(model, rows: int, length: int) -> int:
    """What one decode step reads: every weight (and quantized buffer) once, and the keys and values of `length`
    positions of every row and layer."""
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    a = model.args
    cache = 2 * a.n_layers * rows * a.n_kv_heads * length * a.head_dim * model.model.embed_tokens.weight.element_size()
    return weights + cache


def timed(model, prompts, new: int, static: bool, device: str) -> float:
    from lora_llama.model.generate import sample_completions

    seeds = list(range(len(prompts)))
    return seconds(
        device,
        lambda: sample_completions(
            model, prompts, new, eos_ids=[], pad_id=0, temperature=1.0, seeds=seeds, static=static
        ),
    )


def timed_generate(model, prompt, new: int, static: bool, device: str) -> float:
    from lora_llama.model.generate import generate

    return seconds(device, lambda: generate(model, prompt, new, temperature=1.0, seed=0, static=static))


def generate_figures(model, prompt, a) -> dict:
    """`lora-llama generate`'s loop, one prompt, `new` seeded tokens: tokens/s with the growing cache and the static
    one."""
    figures = {}
    for static in (False, True):
        timed_generate(model, prompt, a.new, static, a.device)  # warm-up
        best = min(timed_generate(model, prompt, a.new, static, a.device) for _ in range(a.repeats))
        figures[f"{'static' if static else 'growing'}_tokens_per_s"] = round(a.new / best, 1)
    return figures


def measure(name: str, a, folder, bandwidth: float) -> dict:
    from lora_llama import LoraSettings, apply_lora, load_model

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = load_model(folder, dtype=dtype, device=a.device)
    apply_lora(model, LoraSettings(r=16, alpha=32, targets=["q", "k", "v", "o", "gate", "up", "down"]))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (a.prompt,), generator=g).tolist() for _ in range(a.rows)]
    figures = {}
    for static in (False, True):
        timed(model, prompts, a.new, static, a.device)  # warm-up: allocations, the graph's capture
        full = min(timed(model, prompts, a.new, static, a.device) for _ in range(a.repeats))
        one = min(timed(model, prompts, 1, static, a.device) for _ in range(a.repeats))
        step_s = (full - one) / (a.new - 1)
        length = a.prompt + a.new if static else a.prompt + a.new // 2  # the static cache reads all its length
        floor = step_bytes(model, a.rows, length) / bandwidth
        figures["static" if static else "growing"] = {
            "completion_tokens_per_s": round(a.rows * a.new / full, 1),
            "decode_step_ms": round(step_s * 1e3, 3),
            "bandwidth_floor_ms": round(floor * 1e3, 4),
            "step_over_floor": round(step_s / floor, 2),
        }
    figures["static_vs_growing_tokens_per_s"] = round(
        figures["static"]["completion_tokens_per_s"] / figures["growing"]["completion_tokens_per_s"], 3
    )
    figures["generate"] = generate_figures(model, prompts[0], a)
    print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
    return figures


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--models", help=f"comma-separated, of {', '.join(MODELS)} (default: both on a GPU, 135m on the CPU)"
    )
    ap.add_argument("--rows", type=int, default=32, help="completions decoded together (prompts x group)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="tokens each completion decodes")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each path (the fastest counts)")
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(2)
    models = (a.models or ("135m,1b" if a.device == "cuda" else "135m")).split(",")
    print(cpu_line())
    bandwidth = copy_bandwidth(a.device)
    print(f"copy bandwidth on {a.device}: {bandwidth / 1e9:.0f} GB/s (read + written)")
    tmp = scratch_dir("lora-llama-decode-bench-")
    runs = {name: measure(name, a, random_model(tmp / name, MODELS[name], a.device), bandwidth) for name in models}
    record("decode", {"device": a.device, "copy_gb_per_s": round(bandwidth / 1e9, 1), "runs": runs})


if __name__ == "__main__":
    main()
