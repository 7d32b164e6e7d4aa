"""`make demo`'s time after setup: the default recipe trained (`lora-llama train`, evals included) and the four
answers compared (`lora-llama generate --compare`), as the Makefile runs them, timed separately; with the held-out
loss before and after. Run it alone: it measures the machine."""

import json
import re
import subprocess
import sys
import time

from bench.common import ROOT, cpu_line, record, scratch_dir


def demo_commands(out) -> tuple[list[str], list[str]]:
    """The Makefile's demo commands, with the run written to `out`."""
    make = (ROOT / "Makefile").read_text()
    prompts = re.findall(r'--prompt "([^"]+)"', make.split("DEMO_PROMPTS :=")[1].split("\n.PHONY")[0])
    train = ["train", "recipes/smollm2-chat-cpu.yaml", "--force", f"output.dir={out}"]
    compare = ["generate", "--chat", "--compare", "--adapter", f"{out}/adapter", "--max-new-tokens", "40"]
    return train, compare + [x for p in prompts for x in ("--prompt", p)]


def main():
    out = scratch_dir("lora-llama-demo-bench-") / "run"
    seconds = {}
    for name, args in zip(("train", "answers"), demo_commands(out)):
        start = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "lora_llama", *args], cwd=ROOT, capture_output=True, text=True)
        seconds[name] = round(time.perf_counter() - start, 1)
        if r.returncode:
            sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
        if name == "train":
            result = json.loads(r.stdout.strip().splitlines()[-1])
    print(cpu_line())
    print(f"train {seconds['train']} s, answers {seconds['answers']} s")
    record(
        "demo",
        {
            "seconds": {**seconds, "total": round(sum(seconds.values()), 1)},
            "eval_loss": {"base": round(result["eval_loss_start"], 4), "adapter": round(result["eval_loss"], 4)},
        },
    )


if __name__ == "__main__":
    main()
