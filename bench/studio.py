"""What watching a run costs it: `lora-llama train recipes/smollm2-chat-cpu.yaml` for 24 steps alone, then again
with `lora-llama studio` serving its runs folder and a headless Chromium page open on the run (the page polls
every 2 s and redraws the curves as they grow). The median tokens/s of each (the first 4 steps left out) go to
bench/results/studio.jsonl."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import threading
import time

from bench.common import ROOT, cpu_line, record, scratch_dir

STEPS, WARMUP = 24, 4


def train(runs, name) -> subprocess.Popen:
    args = ["train", "recipes/smollm2-chat-cpu.yaml", f"train.max_steps={STEPS}", "train.eval_every=1000"]
    args += ["train.save_every=1000", f"output.dir={runs / name}"]
    return subprocess.Popen(
        [sys.executable, "-m", "lora_llama", *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def tokens_per_s(run) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in rows if "loss" in r and r["step"] > WARMUP)


def watched(runs, name):
    """A run trained while a headless Chromium page shows it through the studio."""
    from playwright.sync_api import sync_playwright

    from lora_llama.studio.server import serve

    ready = []
    threading.Thread(target=serve, args=(runs, "127.0.0.1", 0, None, ready.append), daemon=True).start()
    while not ready:
        time.sleep(0.05)
    process = train(runs, name)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.goto(ready[0])
        page.wait_for_selector(f"tr.run[data-name={name}]", timeout=120_000)
        page.click(f"tr.run[data-name={name}]")
        process.wait()
        polled = page.evaluate("performance.getEntriesByType('resource').length")
        browser.close()
    return polled


def main():
    runs = scratch_dir("lora-llama-studio-")
    alone = train(runs, "alone")
    alone.wait()
    polled = watched(runs, "watched")
    figures = {
        "alone_tokens_per_s": tokens_per_s(runs / "alone"),
        "watched_tokens_per_s": tokens_per_s(runs / "watched"),
    }
    figures["ratio"] = figures["watched_tokens_per_s"] / figures["alone_tokens_per_s"]
    figures = {k: round(v, 3) for k, v in figures.items()}
    print(cpu_line())
    print(
        f"tokens/s alone {figures['alone_tokens_per_s']:.0f}, watched {figures['watched_tokens_per_s']:.0f} "
        f"({figures['ratio']:.3f}x; the page made {polled} requests)"
    )
    record("studio", figures)


if __name__ == "__main__":
    main()
