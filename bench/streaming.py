"""Peak memory of a streamed run against the size of its corpus: `lora-llama train` on
`recipes/smollm2-shakespeare-cpu.yaml` with `data.streaming: true` and packing, over a text corpus of the plays
repeated to 50 MB and to 1 GB (each line a record), 20 steps each, no held-out data. The process's peak resident
memory (getrusage of the child) for each goes to bench/results/streaming.jsonl; the two are the same within a few
percent when nothing of the corpus is held whole."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.common import ROOT, cpu_line, no_arguments, record, scratch_dir
from lora_llama.registry import registered_data_dir

SIZES_MB = (50, 1000)


def corpus(path, megabytes: int):
    """The plays (modern spelling) written again and again to `megabytes`."""
    plays = "".join(
        f.read_text(encoding="utf-8", errors="replace")
        for f in sorted((registered_data_dir("shakespeare") / "texts").glob("*.txt"))
        if not f.stem.endswith("_f")
    ).encode()
    with open(path, "wb") as f:
        for _ in range(megabytes * 2**20 // len(plays) + 1):
            f.write(plays)
    return path


def peak_of_run(source, out) -> tuple[float, float]:
    """(peak resident MB, seconds) of one run in a child process that this wrapper alone waits for."""
    recipe = str(ROOT / "recipes" / "smollm2-shakespeare-cpu.yaml")
    args = [
        "train",
        recipe,
        f"data.source={source}",
        "data.streaming=true",
        "data.packing=true",
        "data.val_size=0",
        "train.max_steps=20",
        "train.eval_every=1000",
        "train.save_every=1000",
        f"output.dir={out}",
    ]
    wrapper = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "rc = subprocess.run([sys.executable, '-m', 'lora_llama', *sys.argv[1:]]).returncode; "
        "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.perf_counter() - t)"
    )
    done = subprocess.run([sys.executable, "-c", wrapper, *args], cwd=ROOT, capture_output=True, text=True, check=True)
    rc, kb, seconds = done.stdout.split()[-3:]
    if rc != "0":
        sys.exit(f"the run failed:\n{done.stderr[-2000:]}")
    return int(kb) / 1024, float(seconds)


def main():
    no_arguments(__doc__)
    tmp = scratch_dir("lora-llama-streaming-")
    figures = {}
    for mb in SIZES_MB:
        source = corpus(tmp / f"plays-{mb}mb.txt", mb)
        start = time.perf_counter()
        peak, seconds = peak_of_run(source, tmp / f"run-{mb}")
        figures[mb] = peak
        print(f"{mb} MB corpus: peak {peak:.0f} MB, {seconds:.0f} s ({time.perf_counter() - start:.0f} s in all)")
        (tmp / f"plays-{mb}mb.txt").unlink()
    print(cpu_line())
    ratio = figures[SIZES_MB[1]] / figures[SIZES_MB[0]]
    print(f"peak RSS, {SIZES_MB[1]} MB corpus / {SIZES_MB[0]} MB corpus: {ratio:.3f}")
    record(
        "streaming",
        {**{f"peak_mb_{mb}mb_corpus": round(figures[mb], 1) for mb in SIZES_MB}, "ratio": round(ratio, 3)},
    )


if __name__ == "__main__":
    main()
