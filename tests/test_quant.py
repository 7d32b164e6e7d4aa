"""Frozen int8 base weights through bitsandbytes: accuracy, training, memory, PEFT interchange, nf4 refusal."""

import pytest
import torch

from helpers import ROOT, hf_model, peak_growth, sharded_checkpoint
from lora_llama import LoraSettings, UserError, apply_lora, load_adapter, load_model, merge_lora, save_adapter
from lora_llama.lora import lora_modules
from lora_llama.loss import target_loss
from lora_llama.quant import base_weight_bytes

pytest.importorskip("bitsandbytes")
ALL = ["q", "k", "v", "o", "gate", "up", "down"]


def rel(a, b):
    return float((a - b).norm() / b.norm())


def ids(seed=0):
    return torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_int8_logits_close_to_fp32_and_transformers_bnb(tiny_ckpt):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    x = ids()
    q = load_model(tiny_ckpt, quantize="int8")
    assert type(q.model.layers[0].mlp.up_proj).__name__ == "Linear8bitLt"
    assert type(q.lm_head) is torch.nn.Linear  # lm_head stays in the compute dtype
    ref_hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                                  device_map="cpu", dtype=torch.float32).eval()
    with torch.no_grad():
        fp32, int8, hf8 = load_model(tiny_ckpt)(x), q(x), ref_hf(x).logits.float()
    assert rel(int8, fp32) < 0.05
    assert rel(int8, hf8) < 0.05


def test_int8_base_bytes_at_most_30_percent(tiny_ckpt):
    fp = base_weight_bytes(load_model(tiny_ckpt), decoder_linears_only=True)
    q = base_weight_bytes(load_model(tiny_ckpt, quantize="int8"), decoder_linears_only=True)
    assert q <= 0.30 * fp


def test_int8_training_step_and_run(tiny_ckpt, tmp_path):
    model = load_model(tiny_ckpt, quantize="int8")
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    loss, n = target_loss(model, ids(), ids())
    (loss / n).backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(".lora_A." in k or ".lora_B." in k for k in with_grad)

    from test_train import chat_file, metrics, recipe
    from lora_llama.train import train_from_recipe

    r = recipe(tiny_ckpt, chat_file(tmp_path / "d.jsonl"), tmp_path / "run", "model.quantize=int8", "train.max_steps=30",
               "train.batch_size=8", "train.lr=1e-2", "lora.targets=[q,k,v,o,gate,up,down,lm_head]",
               "train.schedule=constant", "train.eval_every=1000", "train.save_every=1000")
    train_from_recipe(r, log=lambda *_: None)
    losses = [m["loss"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert losses[-1] < 0.8 * losses[0]


def test_int8_adapter_in_peft_on_fp32_and_merge_uses_original_weights(tiny_ckpt, tmp_path):
    from peft import PeftModel

    q = load_model(tiny_ckpt, quantize="int8")
    apply_lora(q, LoraSettings(r=4, alpha=8, targets=ALL))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in lora_modules(q).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    save_adapter(q, tmp_path / "a")
    x = ids(2)
    with torch.no_grad():
        native8 = q(x)
        peft32 = PeftModel.from_pretrained(hf_model(tiny_ckpt), tmp_path / "a")(x).logits
    assert rel(native8, peft32) < 0.05
    # merge_lora folds ΔW into the original fp32 W0, so the result equals the fp32 merge exactly
    fp = load_model(tiny_ckpt)
    load_adapter(fp, tmp_path / "a")
    merge_lora(fp)
    merge_lora(q)
    assert type(q.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        assert (q(x) - fp(x)).abs().max() < 1e-5
    with pytest.raises(UserError, match="quantised"):
        again = load_model(tiny_ckpt, quantize="int8")
        load_adapter(again, tmp_path / "a")
        next(iter(lora_modules(again).values())).merge()


def test_nf4_on_cpu_is_refused_clearly(tiny_ckpt, capsys, tmp_path):
    with pytest.raises(UserError, match="nf4 needs a CUDA GPU"):
        load_model(tiny_ckpt, quantize="nf4")
    from test_train import chat_file
    from lora_llama.cli import main

    code = main(["train", str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"), f"model.source={tiny_ckpt}",
                 f"data.source={chat_file(tmp_path / 'd.jsonl')}", f"output.dir={tmp_path / 'run'}", "model.quantize=nf4",
                 "model.device=cpu"])  # (on a machine with a GPU, auto would pick it)
    err = capsys.readouterr().err
    assert code == 2 and "nf4 needs a CUDA GPU" in err and not (tmp_path / "run").exists()


def test_int8_loading_peak_memory_below_fp32_size(tmp_path):
    base, shards = sharded_checkpoint(tmp_path / "big", 8)
    fp32_size = sum(f.stat().st_size for f in shards)
    grown = peak_growth("import torch, bitsandbytes, safetensors\nfrom lora_llama import load_model",
                        "model = load_model(sys.argv[1], quantize='int8')", base)
    print(f"int8 load grew {grown / 1e6:.1f} MB, float32 checkpoint {fp32_size / 1e6:.1f} MB")
    assert grown < fp32_size, (grown, fp32_size)
