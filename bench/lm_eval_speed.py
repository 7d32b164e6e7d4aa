"""lm-eval on the default model: lora-llama's backend (`lora-llama eval --tasks`) against lm-eval's own hf backend
with peft, the same adapter, tasks and batch size, each in a process of its own, in one run. Times the evaluation
alone (models loaded first) and checks that both give the same metrics. Tasks: tasks/chatterbot (multiple choice
and greedy generation), --limit examples each."""

import argparse
import json
import subprocess
import sys

from bench.common import ROOT, cpu_line, record, scratch_dir

RUN = r"""
import json, sys, time
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
backend, folder, adapter, tasks, limit, batch = sys.argv[1:7]
torch.set_num_threads(int(sys.argv[7]))
if backend == "lora-llama":
    from lora_llama import load_adapter, load_model, load_tokenizer
    from lora_llama.harness.lm import native_lm
    model = load_model(folder)
    load_adapter(model, adapter)
    lm = native_lm(model, load_tokenizer(folder), batch_size=int(batch))
else:
    from lm_eval.models.huggingface import HFLM
    lm = HFLM(pretrained=folder, peft=adapter, device="cpu", dtype="float32", batch_size=int(batch))
manager = TaskManager(include_path=tasks)
start = time.perf_counter()
out = simple_evaluate(model=lm, tasks=["chatterbot_mc", "chatterbot_qa"], limit=int(limit), task_manager=manager)
seconds = time.perf_counter() - start
metrics = {
    t: {k: v for k, v in r.items() if isinstance(v, float) and "stderr" not in k} for t, r in out["results"].items()
}
print(json.dumps({"seconds": seconds, "metrics": metrics}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=30, help="examples per task")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from lora_llama import LoraSettings, apply_lora, load_model, save_adapter
    from lora_llama.registry import registered_model_path
    from tests.helpers import random_lora_b

    tmp = scratch_dir("lora-llama-lm-eval-bench-")
    model = load_model("smollm2-135m-instruct")
    folder = model.folder
    apply_lora(model, LoraSettings(r=8, alpha=16, targets=["q", "k", "v", "o"]))
    random_lora_b(model, std=0.02)
    save_adapter(model, tmp / "adapter", base_model=str(registered_model_path("smollm2-135m-instruct")))
    del model
    runs = {}
    for backend in ("lora-llama", "hf"):
        argv = [backend, str(folder), str(tmp / "adapter"), str(ROOT / "tasks"), str(a.limit), str(a.batch_size)]
        r = subprocess.run([sys.executable, "-c", RUN, *argv, str(a.threads)], capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            sys.exit(f"{backend} failed:\n{r.stderr[-3000:]}")
        runs[backend] = json.loads(r.stdout.strip().splitlines()[-1])
    print(cpu_line())
    for backend, r in runs.items():
        print(f"{backend:<12}{r['seconds']:>8.1f} s  {r['metrics']}")
    ours, peer = runs["lora-llama"], runs["hf"]
    record(
        "lm_eval_speed",
        {
            "seconds": {"lora_llama": round(ours["seconds"], 1), "hf_peft": round(peer["seconds"], 1)},
            "metrics": {"lora_llama": ours["metrics"], "hf_peft": peer["metrics"]},
            "same_metrics": ours["metrics"] == peer["metrics"],
            "time_ratio": round(ours["seconds"] / peer["seconds"], 3),
        },
    )


if __name__ == "__main__":
    main()
