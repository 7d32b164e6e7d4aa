"""Table rows of the data, agent and studio benchmarks' results: the tokenized cache, streaming's memory against
the corpus, the calculator agent's stages, a run's speed with a studio page open on it; each function takes one
result line and gives (what, lora-llama, peer, ratio)."""

from __future__ import annotations


def data_cache_rows(r: dict) -> list[tuple]:
    return [
        (
            "seconds to the first step, the shakespeare recipe: tokenizing, then from the cache",
            f"{r['first_run_s']:.1f} s, then {r['second_run_s']:.1f} s",
            "",
            f"{r['ratio']:.2f}x",
        )
    ]


def streaming_rows(r: dict) -> list[tuple]:
    return [
        (
            "peak resident memory of a streamed run (shakespeare recipe, 20 steps): a 50 MB corpus, a 1 GB one",
            f"{r['peak_mb_50mb_corpus']:.0f} MB, {r['peak_mb_1000mb_corpus']:.0f} MB",
            "",
            f"{r['ratio']:.2f}x",
        )
    ]


def agent_rows(r: dict) -> list[tuple]:
    stage = {"base": "SmolLM2-135M-Instruct", "sft": "after the SFT recipe", "grpo": "after the GRPO recipe"}
    rows = [
        (
            f"calculator agent, held-out accuracy (answers calling the tool): {what}",
            f"{r[f'{k}_accuracy']:.3f} ({r[f'{k}_tool_calling']:.3f})",
            "",
            "",
        )
        for k, what in stage.items()
    ]
    for credit, curve in r.get("curves", {}).items():  # each GRPO run's held-out accuracy every few steps
        steps = ", ".join(str(step) for step, _ in curve)
        rows.append(
            (
                f"calculator agent, GRPO with credit: {credit}, held-out accuracy at steps {steps}",
                ", ".join(f"{accuracy:.3f}" for _, accuracy in curve),
                "",
                "",
            )
        )
    minutes = r["sft_minutes"] + r["merge_minutes"] + r["grpo_minutes"]
    rows.append(
        (
            "calculator agent: SFT, merge, GRPO",
            f"{minutes:.1f} minutes ({r['sft_minutes']:.1f} + {r['merge_minutes']:.2f} + {r['grpo_minutes']:.1f})",
            "",
            "",
        )
    )
    return rows


def studio_rows(r: dict) -> list[tuple]:
    return [
        (
            "training tokens/s with a studio page open on the run, against the run alone"
            + (
                f" (the page and the studio: {r['page_and_studio_core_share']:.1%} of a core)"
                if "page_and_studio_core_share" in r
                else ""
            ),
            f"{r['watched_tokens_per_s']:.0f} tok/s",
            f"{r['alone_tokens_per_s']:.0f} tok/s alone",
            f"{r['ratio']:.2f}x",
        )
    ]
