"""Table rows of the training benchmarks' results: the step (CPU and GPU), decoding, long contexts, several processes,
GRPO, DoRA and the adapter variants; each function takes one result line and gives (what, lora-llama, peer, ratio)."""

from __future__ import annotations


def _tok(run: dict) -> str:
    return f"{run['median_step_s']:.2f} s ({run['tokens_per_s']:.0f} tok/s)"


def train_step_rows(r: dict) -> list[tuple]:
    runs, prec = r["runs"], "bf16-mixed" if "bf16-mixed" in r["args"] else "fp32"
    ours, peer = runs["lora-llama"], runs["transformers+peft"]
    rows = [
        (
            f"LoRA step, {prec}, each library in its own process",
            _tok(ours),
            _tok(peer),
            f"{r['tokens_per_s_ratio']:.2f}x tokens/s",
        ),
        (
            "step memory (peak resident growth)",
            f"{ours['step_memory_mb']:.0f} MB",
            f"{peer['step_memory_mb']:.0f} MB",
            f"{r['peak_memory_ratio']:.2f}",
        ),
    ]
    if "paired_step_s" in r:
        p = r["paired_step_s"]
        rows.append(
            (
                "steps alternating in one process",
                f"{p['lora_llama']:.2f} s",
                f"{p['transformers_peft']:.2f} s",
                f"{r['tokens_per_s_ratio_paired']:.2f}x tokens/s",
            )
        )
    if "trl SFTTrainer" in runs:
        trl = runs["trl SFTTrainer"]
        rows.append(
            (
                "trl SFTTrainer, same rows, its own loop",
                _tok(ours),
                _tok(trl),
                f"{ours['tokens_per_s'] / trl['tokens_per_s']:.2f}x tokens/s",
            )
        )
    if "tokens_per_s_ratio_vs_own_fp32" in r:
        rows.append(
            (
                "bf16-mixed against each library's own fp32 step",
                f"{r['tokens_per_s_ratio_vs_own_fp32']:.2f}x",
                "",
                f"{r['tokens_per_s_ratio_vs_peer_fp32']:.2f}x the peer's fp32",
            )
        )
    return rows


def gpu_rows(r: dict) -> list[tuple]:
    """bench.gpu: one configuration against each peer (tokens/s, peak GPU memory; lora-llama's MFU)."""
    runs = r["runs"]

    def cell(v):
        return (
            f"{v['tokens_per_s']:.0f} tok/s, {v['gpu_peak_mb']:.0f} MB"
            if "tokens_per_s" in v
            else f"failed: {v.get('error', '?')[:80]}"
        )

    ours = cell(runs.get("lora-llama", {})) + (f", MFU {r['mfu']:.0%}" if "mfu" in r else "")
    rows = []
    for peer in [p for p in runs if p != "lora-llama"]:
        ratio = (
            f"{r[f'tokens_per_s_vs_{peer}']:.2f}x tokens/s, {r[f'gpu_peak_vs_{peer}']:.2f} memory"
            if f"tokens_per_s_vs_{peer}" in r
            else ""
        )
        rows.append(
            (
                f"{r['config']}, {r['batch']} x {r['seq']}, {r['quantize'] or 'bf16'} base (peer: {peer})",
                ours,
                cell(runs[peer]),
                ratio,
            )
        )
    return rows


def decode_rows(r: dict) -> list[tuple]:
    """bench.decode: GRPO's sampling and `generate`'s loop, the static cache (a replayed CUDA graph on a GPU) against
    the growing one."""

    def cell(v):
        return (
            f"{v['completion_tokens_per_s']:.0f} tok/s, step {v['decode_step_ms']:.2f} ms "
            f"({v['step_over_floor']:.1f}x its floor)"
        )

    rows = []
    for name, v in r["runs"].items():
        rows.append(
            (
                f"{name}: decoding, static cache (peer: the growing cache)",
                cell(v["static"]),
                cell(v["growing"]),
                f"{v['static_vs_growing_tokens_per_s']:.2f}x tokens/s",
            )
        )
        if "generate" in v:  # lora-llama generate's loop, one prompt
            g = v["generate"]
            rows.append(
                (
                    f"{name}: `generate`, one prompt, static cache (peer: the growing cache)",
                    f"{g['static_tokens_per_s']:.1f} tok/s",
                    f"{g['growing_tokens_per_s']:.1f} tok/s",
                    f"{g['static_tokens_per_s'] / g['growing_tokens_per_s']:.2f}x tokens/s",
                )
            )
    return rows


def long_context_rows(r: dict) -> list[tuple]:
    rows = [
        (
            f"{seq} tokens, each side's best (speed; memory)",
            "",
            "",
            f"{v['tokens_per_s']:.2f}x tokens/s; {v['step_memory']:.2f} memory",
        )
        for seq, v in r["ratios"].items()
    ]
    if "longest" in r:
        ours, peer = r["longest"]["lora-llama"], r["longest"]["transformers+peft"]
        rows.append(
            (
                "longest row within the memory budget (checkpointing)",
                str(ours),
                str(peer),
                f"{ours / peer:.0f}x" if peer else "peer: none",
            )
        )
    return rows


def distributed_rows(r: dict) -> list[tuple]:
    if "runs" in r:  # --model llama-1.1b: each rank's peak against one process's
        return distributed_memory_rows(r)
    return [
        (
            f"`lora-llama train`, {k}",
            f"{v['lora_llama']:.0f} tok/s",
            f"{v['peer']:.0f} tok/s",
            f"{r['ratios_vs_peer'][k]:.2f}x",
        )
        for k, v in r["tokens_per_s"].items()
    ]


def distributed_memory_rows(r: dict) -> list[tuple]:
    runs = r["runs"]

    def cell(v):
        return f"{v['peak_mb_per_rank']} MB, {v['tokens_per_s']:.1f} tok/s"

    return [
        (
            f"1.1B float32, {name.split()[0]} base: {name.split(' ', 1)[1]}, peak per rank (peer: 1 process)",
            cell(v),
            cell(runs[name.split()[0] + " 1 process"]),
            f"{v['peak_vs_one_process']:.2f} memory",
        )
        for name, v in runs.items()
        if "1 process" not in name
    ]


def grpo_rows(r: dict) -> list[tuple]:
    runs = r["runs"]

    def cell(v):
        return (
            f"{v['step_s']:.2f} s, {v['completions_per_s']:.1f} compl/s, "
            f"{v['gpu_peak_mb' if 'gpu_peak_mb' in v else 'peak_mb']} MB"
        )

    ours, peer = runs["lora-llama"], runs.get("trl+peft")
    ratio = f"{r['step_time_ratio']:.2f} time, {r['peak_memory_ratio']:.2f} memory" if peer else "peer: did not run"
    return [("GRPO step: sampling and update (peer: trl GRPOTrainer)", cell(ours), cell(peer) if peer else "", ratio)]


def dora_rows(r: dict) -> list[tuple]:
    tps, cost = r["tokens_per_s"], r["dora_step_cost"]
    return [
        (
            "DoRA step / LoRA step, default recipe (peer: peft's DoRA)",
            f"{cost['lora_llama']:.2f}x ({tps['lora_llama']['dora']:.0f} tok/s)",
            f"{cost['peft']:.2f}x ({tps['peft']['dora']:.0f} tok/s)",
            f"{r['dora_vs_peft_dora_tokens_per_s']:.2f}x tokens/s",
        )
    ]


def variants_rows(r: dict) -> list[tuple]:
    return [
        (
            f"{name}: eval loss start -> end",
            f"{v['eval_loss_start']:.4f} -> {v['eval_loss']:.4f}",
            "",
            f"peak {v['peak_mb']} MB",
        )
        for name, v in r["runs"].items()
    ]


def precision_rows(r: dict) -> list[tuple]:
    fp32, bf16 = r["runs"]["fp32"], r["runs"]["bf16-mixed"]

    def cell(v):
        return f"{v['tokens_per_s']:.0f} tok/s, eval loss {v['eval_loss']['adapter']:.4f}"

    return [
        (
            "default recipe, bf16-mixed (peer: the same recipe in fp32)",
            cell(bf16),
            cell(fp32),
            f"{r['tokens_per_s_ratio']:.2f}x tokens/s, eval loss within {100 * r['eval_loss_rel_diff']:.2f}%",
        )
    ]


def recipe_run_rows(r: dict) -> list[tuple]:
    """A shipped recipe's run: its time, then its first and last held-out measures."""
    first, last = r["evals"][0], r["evals"][-1]
    measures = ", ".join(
        f"{k.removeprefix('eval_')} {first[k]:.2f} -> {last[k]:.2f}" for k in last if k != "step" and k in first
    )
    return [
        (
            f"{r['args'][0]}: {r['steps']} steps ({r['precision']}), "
            f"held-out at step {first['step']} -> {last['step']}",
            f"{r['seconds'] / 60:.1f} min ({r['step_s']:.1f} s a step)",
            "",
            measures,
        )
    ]


def preference_packing_rows(r: dict) -> list[tuple]:
    s, p, objective = r["step_s"], r["pairs_per_s"], r.get("objective", "dpo")
    unit = "examples" if objective == "kto" else "pairs"  # KTO reads each pair as two answers judged one at a time
    return [
        (
            f"{objective.upper()} on mixed-length pairs, data.packing true (peer: the same run padded)",
            f"{s['packed']:.2f} s a step, {p['packed']:.2f} {unit}/s",
            f"{s['padded']:.2f} s a step, {p['padded']:.2f} {unit}/s",
            f"{r['speedup']:.2f}x {unit}/s",
        )
    ]


def moe_rows(r: dict) -> list[tuple]:
    tps, peak = r["tokens_per_s"], r["peak_mb"]
    s = r["shapes"]
    what = f"LoRA on attention + experts, Qwen3-MoE {s['num_experts']} experts top-{s['num_experts_per_tok']}, hidden "
    return [
        (
            what + f"{s['hidden_size']} (peer: peft target_parameters)",
            f"{tps['lora-llama']:.0f} tok/s, {peak['lora-llama']:.0f} MB",
            f"{tps['peft']:.0f} tok/s, {peak['peft']:.0f} MB",
            f"{r['speed_ratio']:.2f}x tokens/s, {r['peak_ratio']:.2f}x peak",
        )
    ]
