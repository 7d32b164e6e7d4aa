"""Table rows of the benchmarks of the step's parts: products, the forward pass, LoRA's overhead, merging, int8 and
nf4 bases, dequantization; each function takes one result line and gives (what, lora-llama, peer, ratio)."""

from __future__ import annotations


def forward_rows(r: dict) -> list[tuple]:
    rows = [
        (
            f"forward, batch {k.split('_')[1][1:]} x 512",
            f"{v['lora_llama']:.0f} ms",
            f"{v['transformers']:.0f} ms",
            f"{v['time_ratio']:.2f} (time)",
        )
        for k, v in r.items()
        if k.startswith("forward_b")
    ]
    d = r["decode_tokens_per_s"]
    return rows + [
        (
            "greedy decoding with the KV cache",
            f"{d['lora_llama']:.1f} tok/s",
            f"{d['transformers']:.1f} tok/s",
            f"{d['time_ratio']:.2f} (time)",
        )
    ]


def gemm_rows(r: dict) -> list[tuple]:
    if "int8" in r:  # --int8
        steps, bf16 = [v["int8_step"] for v in r["int8"].values()], [v["bf16"] for v in r["int8"].values()]
        raw = [v["int8_mm"] / v["bf16"] for v in r["int8"].values()]
        return [
            (
                "int8 x int8 products (activations quantized per row, scaled back) vs bf16, GFLOP/s "
                f"(int8 operands alone: {min(raw):.2f}-{max(raw):.2f}x bf16)",
                f"{min(steps)}-{max(steps)}",
                f"{min(bf16)}-{max(bf16)}",
                f"{r['min_ratio']:.2f}-{r['max_ratio']:.2f}",
            )
        ]
    ours = [v["onednn"] for v in r["gflops"].values()]
    peer = [v["F.linear"] for v in r["gflops"].values()]
    return [
        (
            "float32 products of the step, GFLOP/s (oneDNN vs F.linear)",
            f"{min(ours)}-{max(ours)}",
            f"{min(peer)}-{max(peer)}",
            f"{r['min_ratio']:.2f}-{r['max_ratio']:.2f}",
        )
    ]


def lora_overhead_rows(r: dict) -> list[tuple]:
    f = r["forward_ms"]
    return [
        (
            "forward with LoRA r=8 on q,k,v,o, unmerged / merged, against the base",
            f"{f['unmerged']:.0f} / {f['merged']:.0f} ms",
            f"base {f['base']:.0f} ms",
            f"{r['unmerged_ratio']:.2f} / {r['merged_ratio']:.2f}",
        )
    ]


def merge_rows(r: dict) -> list[tuple]:
    return [
        (
            "merge 4 shards + adapter (peer: peft merge_and_unload)",
            f"{r['merge_s']['lora_llama']:.2f} s, {r['peak_growth_mb']['lora_llama']} MB",
            f"{r['merge_s']['peft']:.2f} s, {r['peak_growth_mb']['peft']} MB",
            f"{r['merge_time_ratio']:.2f} time, {r['merge_peak_memory_ratio']:.2f} memory",
        )
    ]


def int8_rows(r: dict) -> list[tuple]:
    return [
        (
            f"{kind} base, step batch 2 x 256 (peer: transformers+bitsandbytes)",
            f"{v['step_s']['lora_llama']:.2f} s, {v['base_mb']['lora_llama']:.0f} MB",
            f"{v['step_s']['transformers']:.2f} s, {v['base_mb']['transformers']:.0f} MB",
            f"{v['step_s']['lora_llama'] / v['step_s']['transformers']:.2f} (time)",
        )
        for kind, v in r["rows"].items()
    ]


QUANT_MODELS = {"llama-1.1b": "1.1B", "smollm2-like": "default recipe, random weights"}


def quant_rows(r: dict) -> list[tuple]:
    """Speed and peak against no quantization; the eval loss at step 0 (not measured on the 1.1B model)."""
    none, gpu = r["runs"]["none"], "gpu_peak_vs_none" in r  # on a GPU, the peak of GPU memory

    def cell(v):
        return f"{v['tokens_per_s']:.0f} tok/s, {v['gpu_peak_mb' if gpu else 'peak_mb']:.0f} MB"

    mem = r["gpu_peak_vs_none" if gpu else "peak_memory_vs_none"]
    named = next((a for a in r["args"] if a in QUANT_MODELS), None)  # --model
    model = QUANT_MODELS.get(named, "default recipe")

    def evals(v):
        if v.get("eval_loss_step_0") is None or named == "smollm2-like":  # a random model's eval loss means nothing
            return ""
        end = v.get("eval_loss_end")
        return f", eval {v['eval_loss_step_0']:.4f}" + (f" -> {end:.4f}" if end is not None else "")

    return [
        (
            f"{model}, {kind} vs none",
            cell(v),
            cell(none),
            f"{r['tokens_per_s_vs_none'][kind]:.2f}x, {mem[kind]:.2f} {'GPU ' if gpu else ''}mem{evals(v)}",
        )
        for kind, v in r["runs"].items()
        if kind != "none"
    ]


def dequant_rows(r: dict) -> list[tuple]:
    """Per format: the just-in-time dequantization of a 5632 x 2048 weight, and its share of the product it serves
    (beside what a layer runs: on a GPU the eager and the compiled kernels' times, on the CPU the eager kernels'
    into fresh memory)."""
    rows, eager, compiled = list(r["product_ms"]), r.get("eager_dequantize_ms"), r.get("compiled_dequantize_ms")

    def both(kind):
        return (
            f" on {r['device']} (eager {eager[kind]:.2f} ms, compiled {compiled[kind]:.2f})"
            if compiled
            else f" (whole, into fresh memory: {eager[kind]:.1f} ms)"
            if eager
            else ""
        )

    return [
        (
            f"dequantize a {r['shape'][0]} x {r['shape'][1]} {kind} weight into {r['dtype']}{both(kind)}",
            f"{ms:.2f} ms" if compiled else f"{ms:.1f} ms",
            ", ".join(f"{n}-row product {r['product_ms'][n]:.2f} ms" for n in rows),
            " / ".join(f"{ms / r['product_ms'][n]:.2f}" for n in rows),
        )
        for kind, ms in r["dequantize_ms"].items()
    ]


def lm_eval_speed_rows(r: dict) -> list[tuple]:
    same = "same metrics" if r["same_metrics"] else "metrics differ"
    return [
        (
            "lm-eval, chatterbot tasks, adapter (peer: lm-eval's hf backend with peft)",
            f"{r['seconds']['lora_llama']:.1f} s",
            f"{r['seconds']['hf_peft']:.1f} s",
            f"{r['time_ratio']:.2f} time, {same}",
        )
    ]


def demo_rows(r: dict) -> list[tuple]:
    s = r["seconds"]
    rows = [
        (
            "`make demo` after setup: the default recipe trained"
            + (f" ({r['precision']})" if "precision" in r else "")
            + ", then four answers compared",
            f"{s['total'] / 60:.1f} min ({s['train'] / 60:.1f} training, {s['answers'] / 60:.1f} answering)",
            "",
            f"eval loss {r['eval_loss']['base']:.4f} -> {r['eval_loss']['adapter']:.4f}",
        )
    ]
    if "chatterbot_mc" in r:  # make demo-eval: lm-eval on the base and the demo's adapter
        acc = r["chatterbot_mc"]["acc,none"]
        rows.append(
            (
                "`make demo-eval`: lm-eval's chatterbot_mc, the base and the adapter",
                f"{s['demo_eval'] / 60:.1f} min",
                "",
                f"acc {acc['base']:.4f} -> {acc['adapter']:.4f}",
            )
        )
    return rows


def setup_rows(r: dict) -> list[tuple]:
    largest = ", ".join(f"{name} {mb / 1000:.2f} GB" for name, mb in r["largest_mb"].items())
    return [
        (
            "`make setup` into a new environment (from the machine's package mirror)",
            f"{r['seconds'] / 60:.1f} min",
            "",
            f"{r['installed_mb'] / 1000:.1f} GB installed ({largest})",
        )
    ]


CPU_SHAPES = {"135m": "SmolLM2-135M", "360m": "SmolLM2-360M", "0.5b": "Qwen2.5-0.5B", "1b": "Llama-3.2-1B"}


def cpu_rows(r: dict) -> list[tuple]:
    """bench.cpu: the default recipe's ratio to the GEMM rate, then each size beside transformers+peft."""
    rows = []
    for row in r["rows"]:
        ours, gemm = row["lora_llama"], f"{row['gemm_ratio']:.2f} of torch's GEMM rate"
        if "peer" not in row:  # the default recipe, measured against the GEMM rate alone
            share = row.get("target_share")  # the loss's share of the tokens; counted as 1 in lines without it
            counted = f"{share:.0%} of its tokens targets" if share else "the head counted at every token"
            rows.append(
                (
                    f"default recipe ({row['precision']}): useful GFLOP/s, {counted} "
                    "(peer: torch's products at its shapes)",
                    f"{ours['tokens_per_s']:.0f} tok/s, {row['useful_gflops']} GFLOP/s",
                    f"{row['gemm_gflops']['model']} GFLOP/s",
                    gemm,
                )
            )
            continue
        peer = row["peer"]
        failed = "failed" in peer  # the peer's process did not finish (out of memory, most often)
        theirs = (
            f"did not finish: {peer['failed']}" if failed else f"{peer['tokens_per_s']:.0f} tok/s, {peer['peak_mb']} MB"
        )
        rows.append(
            (
                f"{CPU_SHAPES[row['size']]} shapes, 4 x 512, r=16 on all linears ({row['precision']}); "
                f"10M tokens: {row['hours_per_10m_tokens']} h",
                f"{ours['tokens_per_s']:.0f} tok/s, {ours['peak_mb']} MB ({gemm})",
                theirs,
                "" if failed else f"{row['tokens_per_s_ratio']:.2f}x tokens/s, {row['memory_ratio']:.2f} memory",
            )
        )
    return rows
