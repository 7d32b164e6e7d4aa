"""float32 vs int8 base weights: load time, base-weight memory, train-step time; native vs transformers+bitsandbytes.

Same random model (SmolLM2-135M shapes) and batch for all, one run; ratios printed.
nf4 runs only on CUDA (bitsandbytes' 4-bit CPU path is unreliable) and is skipped here otherwise.
"""

import argparse
import time

import torch

from bench.common import cpu_line, median_time, random_checkpoint, record
from lora_llama import LoraSettings, apply_lora, load_model
from lora_llama.objectives.token_losses import target_loss
from lora_llama.quant.linear import base_weight_bytes

TARGETS = ["q", "k", "v", "o"]


def hf_bytes(model) -> int:
    """Bytes of the parameters and buffers, a tied weight counted once (as base_weight_bytes does)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def measure(folder, ids, q: str | None) -> dict:
    """Load time, base weight memory and step time, ours | transformers (bitsandbytes for int8 / nf4)."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    t = time.perf_counter()
    native = load_model(folder, quantize=q)
    load_native = time.perf_counter() - t
    apply_lora(native, LoraSettings(r=16, alpha=32, targets=TARGETS))
    native.train()

    def native_step():
        s, n = target_loss(native, ids, ids)
        (s / n).backward()

    t = time.perf_counter()
    qcfg = {
        None: None,
        "int8": BitsAndBytesConfig(load_in_8bit=True),
        "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    }[q]
    hf = LlamaForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=qcfg, device_map="cpu" if q else None
    )
    load_hf = time.perf_counter() - t
    hf_mem = hf_bytes(hf)
    hf = get_peft_model(hf, LoraConfig(r=16, lora_alpha=32, target_modules=[f"{x}_proj" for x in TARGETS]))
    hf.train()

    def hf_step():
        hf(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return {
        "load_s": (load_native, load_hf),
        "base_mb": (base_weight_bytes(native) / 1e6, hf_mem / 1e6),
        "step_s": (median_time(native_step, 3), median_time(hf_step, 3)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(2)
    folder = random_checkpoint(shards=4)
    ids = torch.randint(3, 49152, (a.batch, a.seq))
    kinds = [None, "int8"] + (["nf4"] if torch.cuda.is_available() else [])
    # one kind at a time: the next kind's models load into the memory these free
    rows = {q or "float32": measure(folder, ids, q) for q in kinds}
    print(cpu_line())
    print(f"batch {a.batch} x {a.seq}, LoRA r=16 on q,k,v,o; each cell: native | transformers (ratio)")
    for name, r in rows.items():
        cells = [f"{k} {n:.2f} | {h:.2f} ({n / h:.2f})" for k, (n, h) in r.items()]
        print(f"{name:<8} " + "   ".join(cells))
    f32, i8 = rows["float32"], rows["int8"]
    table = {
        name: {k: {"lora_llama": round(n, 3), "transformers": round(h, 3)} for k, (n, h) in r.items()}
        for name, r in rows.items()
    }
    record(
        "int8",
        {
            "rows": table,
            "int8_load_ratio": round(i8["load_s"][0] / i8["load_s"][1], 3),
            "int8_base_memory_ratio": round(i8["base_mb"][0] / i8["base_mb"][1], 3),
            "int8_step_ratio": round(i8["step_s"][0] / i8["step_s"][1], 3),
            "int8_vs_fp32_native_memory": round(i8["base_mb"][0] / f32["base_mb"][0], 3),
        },
    )


if __name__ == "__main__":
    main()
