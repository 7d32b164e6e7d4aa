"""`make demo`'s time after setup: the default recipe trained (`lora-llama train`, evals included) and the four
answers compared (`lora-llama generate --compare`), as the Makefile runs them, timed separately; with the held-out
loss before and after and the answers themselves; then `make demo-eval`'s benchmark (lm-eval's chatterbot_mc on
the base and the adapter), timed, with its scores. Run it alone: it measures the machine."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, cpu_line, no_arguments, record, scratch_dir


def demo_commands(out) -> tuple[list[str], list[str], list[str]]:
    """The Makefile's demo and demo-eval commands, with the run written to `out`."""
    make = (ROOT / "Makefile").read_text()
    prompts = re.findall(r'--prompt "([^"]+)"', make.split("DEMO_PROMPTS :=")[1].split("\n.PHONY")[0])
    train = ["train", "recipes/smollm2-chat-cpu.yaml", "--force", f"output.dir={out}"]
    compare = ["generate", "--chat", "--compare", "--adapter", f"{out}/adapter", "--max-new-tokens", "40"]
    evaluate = ["eval", "--adapter", f"{out}/adapter", "--tasks", "chatterbot_mc", "--include-path", "tasks"]
    evaluate += ["--compare", "--output", f"{out}/chatterbot_mc.json", "--force"]
    return train, compare + [x for p in prompts for x in ("--prompt", p)], evaluate


def scores(results: Path) -> dict:
    """{metric: {"base": ..., "adapter": ...}} of chatterbot_mc from `eval --compare --output`'s file."""
    both = json.loads(results.read_text())
    return {
        metric: {side: round(both[side]["results"]["chatterbot_mc"][metric], 4) for side in ("base", "adapter")}
        for metric in ("acc,none", "acc_norm,none")
    }


def main():
    no_arguments(__doc__)
    out = scratch_dir("lora-llama-demo-bench-") / "run"
    seconds, printed = {}, {}
    for name, args in zip(("train", "answers", "demo_eval"), demo_commands(out)):
        start = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "lora_llama", *args], cwd=ROOT, capture_output=True, text=True)
        seconds[name] = round(time.perf_counter() - start, 1)
        if r.returncode:
            sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
        printed[name] = r.stdout
    result = json.loads(printed["train"].strip().splitlines()[-1])
    print(cpu_line())
    print(f"train {seconds['train']} s, answers {seconds['answers']} s, demo-eval {seconds['demo_eval']} s")
    print(printed["answers"])
    record(
        "demo",
        {
            "seconds": {**seconds, "total": round(seconds["train"] + seconds["answers"], 1)},
            "precision": re.search(r"precision (\S+)", printed["train"]).group(1),
            "eval_loss": {"base": round(result["eval_loss_start"], 4), "adapter": round(result["eval_loss"], 4)},
            "answers": printed["answers"].strip(),
            "chatterbot_mc": scores(out / "chatterbot_mc.json"),
        },
    )


if __name__ == "__main__":
    main()
