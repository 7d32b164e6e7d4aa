"""Merge: `lora-llama merge` vs peft's merge_and_unload + save_pretrained, one run.

Same sharded random base (SmolLM2-135M shapes) and adapter (r=16 on q,k,v,o,gate,up,down).
Each merge runs in its own subprocess for an honest peak memory. Then the merged
model's forward latency against the base (the zero-latency check). Ratios printed.
"""

import json
import subprocess
import sys

import torch

from bench.common import ROOT, cpu_line, median_time, no_arguments, random_checkpoint, record, scratch_dir

# measured in a fresh process: VmHWM is that process's own peak, reset once imports are done
MEASURE = r"""
import json, sys, time
import torch, safetensors, peft, transformers, lora_llama.outputs.merge
from bench.common import reset_peak, status_mb
before = status_mb("VmRSS")
reset_peak()
t = time.perf_counter()
"""
REPORT = r"""
print(json.dumps({"s": time.perf_counter() - t, "peak_mb": status_mb("VmHWM") - before}))
"""
NATIVE = (
    MEASURE
    + r"""
lora_llama.outputs.merge.merge_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], progress=False)
"""
    + REPORT
)
PEFT = (
    MEASURE
    + r"""
base = transformers.LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model = peft.PeftModel.from_pretrained(base, sys.argv[2])
model.merge_and_unload().save_pretrained(sys.argv[3], max_shard_size="200MB")
"""
    + REPORT
)


def main():
    no_arguments(__doc__)
    torch.set_num_threads(2)
    from lora_llama import LoraSettings, apply_lora, load_model, save_adapter
    from lora_llama.lora.adapted import lora_modules

    tmp = scratch_dir("lora-llama-merge-bench-")
    base = random_checkpoint(tmp / "base", shards=4)
    model = load_model(base)
    apply_lora(model, LoraSettings(r=16, alpha=32, targets=["q", "k", "v", "o", "gate", "up", "down"]))
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.01)
    save_adapter(model, tmp / "adapter")
    del model
    res = {}
    for name, script in (("lora-llama merge", NATIVE), ("peft merge_and_unload", PEFT)):
        r = subprocess.run(
            [sys.executable, "-c", script, str(base), str(tmp / "adapter"), str(tmp / name.split()[0])],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )  # the checkout, also when not installed
        if r.returncode != 0:
            sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
        res[name] = json.loads(r.stdout.strip().splitlines()[-1])
    x = torch.randint(3, 49152, (1, 512))
    with torch.no_grad():
        base_model, merged = load_model(base), load_model(tmp / "lora-llama")
        t_base = median_time(lambda: base_model(x), 5)
        t_merged = median_time(lambda: merged(x), 5)
    print(cpu_line())
    print(f"{'':<24}{'seconds':>9}{'peak MB (growth)':>17}")
    for name, r in res.items():
        print(f"{name:<24}{r['s']:>9.2f}{r['peak_mb']:>17.0f}")
    print(f"forward b=1 T=512: base {t_base * 1e3:.0f} ms, merged {t_merged * 1e3:.0f} ms")
    ours, ref = res["lora-llama merge"], res["peft merge_and_unload"]
    record(
        "merge",
        {
            "merge_s": {"lora_llama": round(ours["s"], 2), "peft": round(ref["s"], 2)},
            "peak_growth_mb": {"lora_llama": round(ours["peak_mb"]), "peft": round(ref["peak_mb"])},
            "forward_ms": {"base": round(t_base * 1e3, 1), "merged": round(t_merged * 1e3, 1)},
            "merge_time_ratio": round(ours["s"] / ref["s"], 3),
            "merge_peak_memory_ratio": round(ours["peak_mb"] / ref["peak_mb"], 3),
            "merged_forward_ratio": round(t_merged / t_base, 3),
        },
    )


if __name__ == "__main__":
    main()
