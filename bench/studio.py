"""What watching a run costs it: `lora-llama train recipes/smollm2-chat-cpu.yaml` for 24 steps, started from
`lora-llama studio`, with no page open on it and with a headless Chromium page showing it (the page reads the run
every 2 s, redraws the curves as they grow and follows the trainer's output as it is written). The median tokens/s
of each (the first 4 steps left out) go to bench/results/studio.jsonl."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

from bench.common import cpu_line, no_arguments, record, scratch_dir
from lora_llama.studio.client import StudioClient

STEPS, WARMUP = 24, 4
SETTLE_S = 30  # a browser's first seconds: its start-up work, before any run
RECIPE = "recipes/smollm2-chat-cpu.yaml"
SETTINGS = {"train.max_steps": str(STEPS), "train.eval_every": "1000", "train.save_every": "1000"}


def start(url: str, name: str) -> None:
    """The run started from the studio, as its New run form does."""
    StudioClient(url).call("api/start", {"base": RECIPE, "name": name, "values": SETTINGS})


def wait_finished(run: Path) -> None:
    from lora_llama.studio.runs import is_running

    while is_running(run) or not (run / "adapter" / "adapter_config.json").is_file():
        time.sleep(0.5)


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


def watched(browser, url: str, runs: Path, name: str) -> float:
    """A run trained while a page of the browser shows it; the CPU seconds the page and the studio used, over the
    wall seconds of the run."""
    page = browser.new_page()
    page.goto(url)
    cpu, ours, wall = chromium_cpu_s(), time.process_time(), time.perf_counter()
    start(url, name)
    page.wait_for_selector(f"tr.run[data-name={name}]", timeout=120_000)
    page.click(f"tr.run[data-name={name}]")
    page.wait_for_selector(f"#detail[data-name={name}][data-status=finished]", timeout=3_600_000)
    used = chromium_cpu_s() - cpu + time.process_time() - ours
    wall = time.perf_counter() - wall
    page.close()
    return used / wall


def main():
    no_arguments(__doc__)
    """Alone and watched in turn, three of each (A W W A A W), so that the machine's drift over the bench's minutes
    falls on both; each kind's mean. Every run starts from the studio; the browser runs throughout (started and
    settled before the first run, as a user's is), and a watched run has a page of it open on the run. The share of
    one core the page and the studio used says what watching takes."""
    from playwright.sync_api import sync_playwright

    from lora_llama.studio.server import serve

    runs, speeds, shares, ready = scratch_dir("lora-llama-studio-"), {"alone": [], "watched": []}, [], []
    threading.Thread(target=serve, args=(runs, "127.0.0.1", 0), kwargs={"ready": ready.append}, daemon=True).start()
    while not ready:
        time.sleep(0.05)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu"])
        first = browser.new_page()
        first.goto(ready[0])
        time.sleep(SETTLE_S)
        first.close()
        for i, kind in enumerate(("alone", "watched", "watched", "alone", "alone", "watched")):
            name = f"{kind}-{i}"
            if kind == "alone":
                start(ready[0], name)
                wait_finished(runs / name)
            else:
                shares.append(watched(browser, ready[0], runs, name))
            speeds[kind].append(tokens_per_s(runs / name))
        browser.close()
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
