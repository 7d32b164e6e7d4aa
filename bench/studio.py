"""What watching a run costs it: `lora-llama train recipes/smollm2-chat-cpu.yaml` for 24 steps alone, then the same
run started from `lora-llama studio` with a headless Chromium page open on it (the page reads the run every 2 s,
redraws the curves as they grow and follows the trainer's output as it is written). The median tokens/s of each
(the first 4 steps left out) go to bench/results/studio.jsonl."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import ROOT, cpu_line, record, scratch_dir

STEPS, WARMUP = 24, 4


RECIPE = "recipes/smollm2-chat-cpu.yaml"
SETTINGS = {"train.max_steps": str(STEPS), "train.eval_every": "1000", "train.save_every": "1000"}


def train(runs, name) -> subprocess.Popen:
    args = ["train", RECIPE, *(f"{k}={v}" for k, v in SETTINGS.items()), f"output.dir={runs / name}"]
    return subprocess.Popen(
        [sys.executable, "-m", "lora_llama", *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def tokens_per_s(run) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in rows if "loss" in r and r["step"] > WARMUP)


def chromium_cpu_s() -> float:
    """CPU seconds every Chromium process has used so far."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "chrom" in Path(f"/proc/{pid}/comm").read_text():
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:  # a process that ended meanwhile
            continue
    return total / os.sysconf("SC_CLK_TCK")


def watched(runs, name) -> float:
    """A run started from the studio and trained while a headless Chromium page shows it; the CPU seconds the page
    and the studio used, over the wall seconds of the run."""
    from playwright.sync_api import sync_playwright

    from lora_llama.studio.server import serve

    ready = []
    threading.Thread(target=serve, args=(runs, "127.0.0.1", 0, None, ready.append), daemon=True).start()
    while not ready:
        time.sleep(0.05)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.goto(ready[0])
        cpu, ours, wall = chromium_cpu_s(), time.process_time(), time.perf_counter()
        start = {"base": RECIPE, "name": name, "values": SETTINGS}
        request = urllib.request.Request(ready[0] + "api/start", json.dumps(start).encode(), method="POST")
        urllib.request.urlopen(request)
        page.wait_for_selector(f"tr.run[data-name={name}]", timeout=120_000)
        page.click(f"tr.run[data-name={name}]")
        page.wait_for_selector(f"#detail[data-name={name}][data-status=finished]", timeout=3_600_000)
        used = chromium_cpu_s() - cpu + time.process_time() - ours
        wall = time.perf_counter() - wall
        browser.close()
    return used / wall


def main():
    """Alone and watched in turn, three of each (A W W A A W), so that the machine's drift over the bench's minutes
    falls on both; each kind's mean. The share of one core the page and the studio used says what watching takes."""
    runs, speeds, shares = scratch_dir("lora-llama-studio-"), {"alone": [], "watched": []}, []
    for i, kind in enumerate(("alone", "watched", "watched", "alone", "alone", "watched")):
        if kind == "alone":
            train(runs, f"alone-{i}").wait()
        else:
            shares.append(watched(runs, f"watched-{i}"))
        speeds[kind].append(tokens_per_s(runs / f"{kind}-{i}"))
    figures = {f"{kind}_tokens_per_s": statistics.mean(v) for kind, v in speeds.items()}
    figures["ratio"] = figures["watched_tokens_per_s"] / figures["alone_tokens_per_s"]
    figures["page_and_studio_core_share"] = statistics.mean(shares)
    figures = {k: round(v, 3) for k, v in figures.items()}
    print(cpu_line())
    print(
        f"tokens/s alone {figures['alone_tokens_per_s']:.0f} ({', '.join(f'{v:.0f}' for v in speeds['alone'])}), "
        f"watched {figures['watched_tokens_per_s']:.0f} ({', '.join(f'{v:.0f}' for v in speeds['watched'])}): "
        f"{figures['ratio']:.3f}x; the page and the studio used {figures['page_and_studio_core_share']:.1%} of a core"
    )
    record("studio", figures)


if __name__ == "__main__":
    main()
