"""Packed preference batches against padded ones: DPO (or `--objective` orpo, kto) through `lora-llama train` on
SmolLM2-135M-Instruct, on pairs of mixed length (chosen answers of 50-400 words, rejected ones of 5-40, short
prompts), with `data.packing` false and true. Each is run for 2 and for 10 steps and the difference taken, so that
loading and tokenizing (the same for both) fall out: seconds a step, pairs (KTO: examples) a second, and the ratio
packed / padded.

    python -m bench.preference_packing [--objective dpo|orpo|kto]

Run it alone: it measures the machine."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

from bench.common import ROOT, cpu_line, record, scratch_dir

WORDS = "the a of to and in is it you that was for on are with as his they be at one have this from".split()
STEPS, BATCH = (2, 10), 4


def pairs_file(folder, n: int = 200, seed: int = 0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = " ".join(rng.choices(WORDS, k=rng.randrange(4, 12))) + "?"
        chosen = " ".join(rng.choices(WORDS, k=rng.randrange(50, 401)))
        rejected = " ".join(rng.choices(WORDS, k=rng.randrange(5, 41)))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def seconds(data, objective: str, packing: bool, steps: int, folder) -> float:
    args = ["train", "recipes/smollm2-dpo-cpu.yaml", f"train.objective={objective}", f"data.source={data}"]
    args += [f"data.packing={str(packing).lower()}"]
    args += ["data.max_seq_len=512", "data.val_size=0", f"train.max_steps={steps}", f"train.batch_size={BATCH}"]
    args += ["train.save_every=1000", "train.eval_every=1000", f"output.dir={folder / f'{packing}-{steps}'}"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lora_llama", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"training failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objective", default="dpo", choices=["dpo", "orpo", "kto"])
    args = parser.parse_args()
    folder = scratch_dir("lora-llama-packing-")
    data = pairs_file(folder)
    step_s = {}
    for packing in (False, True):
        short, long = (seconds(data, args.objective, packing, n, folder) for n in STEPS)
        step_s["packed" if packing else "padded"] = round((long - short) / (STEPS[1] - STEPS[0]), 3)
    print(cpu_line())
    record(
        "preference_packing",
        {
            "objective": args.objective,
            "step_s": step_s,
            "pairs_per_s": {k: round(BATCH / v, 3) for k, v in step_s.items()},
            "speedup": round(step_s["padded"] / step_s["packed"], 3),
        },
    )


if __name__ == "__main__":
    main()
