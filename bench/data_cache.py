"""Time to the first training step of a recipe, run twice with an empty cache of tokenized examples: the first run
tokenizes its data and keeps the examples (data/cache.py), the second reads them back. `lora-llama train` on
`recipes/smollm2-shakespeare-cpu.yaml` (the plays as text windows of 256 tokens, SmolLM2-135M's tokenizer), one
step, no held-out split; the seconds from the command's start to its first metrics line go to
bench/results/data_cache.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench.common import ROOT, cpu_line, no_arguments, record, scratch_dir


def seconds_to_first_step(out, cache, recipe: str) -> float:
    env = {**os.environ, "LORA_LLAMA_CACHE": str(cache), "OMP_NUM_THREADS": "2"}
    args = ["train", recipe, "train.max_steps=1", "data.val_size=0", f"output.dir={out}"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lora_llama", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and any("loss" in json.loads(line) for line in metrics.read_text().splitlines())):
        if proc.poll() is not None:
            sys.exit(f"the run ended first:\n{proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    elapsed = time.perf_counter() - start
    proc.wait()
    return elapsed


def main():
    no_arguments(__doc__)
    tmp = scratch_dir("lora-llama-data-cache-")
    recipe = str(ROOT / "recipes" / "smollm2-shakespeare-cpu.yaml")
    first = seconds_to_first_step(tmp / "first", tmp / "cache", recipe)
    second = seconds_to_first_step(tmp / "second", tmp / "cache", recipe)
    print(cpu_line())
    print(f"seconds to the first step: tokenizing {first:.1f}, from the cache {second:.1f} ({second / first:.2f}x)")
    record(
        "data_cache",
        {"first_run_s": round(first, 2), "second_run_s": round(second, 2), "ratio": round(second / first, 3)},
    )


if __name__ == "__main__":
    main()
