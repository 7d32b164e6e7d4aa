"""The two sides of bench/gpu.py, each run in a process of its own: transformers+peft (with liger-kernel's kernels, or
on bitsandbytes' nf4) in a plain loop, and `lora-llama train`; each returns its step time, tokens/s and GPU peak."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.common import ROOT
from bench.train_step import memory_mb

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # peft's target_parameters


def mixture(folder: str) -> bool:
    """Whether the model has experts (LoRA on attention and experts then, on both sides)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def peer(
    folder: str, rows_file: str, batch: int, quantize: str | None, liger: bool, steps: int, warmup: int, device: str
) -> dict:
    """transformers+peft (optionally with liger-kernel's Llama kernels; on an nf4 base, bitsandbytes' 4-bit layers;
    a mixture's experts through peft's target_parameters, on bf16 experts)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # RoPE, RMSNorm, SwiGLU, fused linear cross-entropy
    extra = {}
    if quantize == "nf4":
        extra["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="sdpa", device_map=device, **extra
    )
    if quantize == "nf4":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # as lora-llama: none
    targets = dict(target_modules=TARGETS)
    if mixture(folder):
        targets = dict(target_modules=TARGETS[:4], target_parameters=EXPERT_PARAMETERS)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, **targets))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    rows = torch.tensor(json.loads(Path(rows_file).read_text()), device=device)
    memory_mb(device, reset=True)
    times = []
    for i in range(warmup + steps):
        ids = rows[(i * batch) % len(rows) :][:batch]
        synchronize(device)
        t = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times[warmup:])
    return {
        "step_s": step_s,
        "first_step_s": times[0],
        "tokens_per_s": batch * rows.shape[1] / step_s,
        "gpu_peak_mb": memory_mb(device, peak=True),
    }


def ours(
    folder: str, data: str, out: str, batch: int, seq: int, quantize: str | None, steps: int, warmup: int, device: str
) -> dict:
    """`lora-llama train` (this process runs the CLI's main) on a recipe of the same settings."""
    from lora_llama.cli import main

    args = [
        "train",
        str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
        f"model.source={folder}",
        f"model.device={device}",
        f"model.quantize={quantize or 'null'}",
        f"data.source={data}",
        "data.format=text",
        f"data.max_seq_len={seq}",
        "data.val_size=0",
        "data.packing=false",
        f"train.batch_size={batch}",
        "train.grad_accum=1",
        f"train.max_steps={warmup + steps}",
        "train.epochs=null",
        "train.precision=bf16-mixed",
        "train.compile=auto",
        "train.eval_every=100000",
        "train.save_every=100000",
        "train.log_every=1",
        "lora.r=16",
        "lora.alpha=32",
        "lora.dropout=0.0",
        f"lora.targets=[q,k,v,o,{'experts' if mixture(folder) else 'gate,up,down'}]",
        f"output.dir={out}",
        "--force",
    ]
    memory_mb(device, reset=True)
    code = main(args)
    if code:
        raise SystemExit(f"lora-llama train exited {code}")
    logged = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in logged if "tokens_per_s" in r]
    first = rates[0]
    rate = statistics.median(rates[warmup:])
    return {
        "step_s": batch * seq / rate,
        "first_step_s": batch * seq / first,
        "tokens_per_s": rate,
        "gpu_peak_mb": memory_mb(device, peak=True),
    }
