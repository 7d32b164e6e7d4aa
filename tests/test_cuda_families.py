"""The mixtures of experts and Gemma 3 on CUDA (skipped without a GPU): logits with LoRA on the experts against
transformers + peft there, nf4 experts training in bf16-mixed, Gemma 3's sliding layers in greedy generation."""

import pytest
import torch
from test_families import GEMMA3
from test_moe import MOE

from helpers import build_checkpoint, hf_model, token_ids
from lora_llama import LoraSettings, apply_lora, load_model, save_adapter
from lora_llama.cli import main
from lora_llama.model.generate import generate

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    model_type, overrides = MOE["qwen3_moe"]
    return build_checkpoint(tmp_path_factory.mktemp("cuda-moe") / "ckpt", family=model_type, **overrides)


def test_expert_lora_on_cuda_gives_peft_logits(mixture, tmp_path):
    from peft import PeftModel

    model = load_model(mixture, device="cuda")
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["q", "v", "experts"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    save_adapter(model, tmp_path / "a")
    peft = PeftModel.from_pretrained(hf_model(mixture).cuda(), tmp_path / "a").eval()
    x = token_ids(2, 32, 3).cuda()
    with torch.no_grad():
        assert (model.eval()(x) - peft(input_ids=x).logits).abs().max() < 1e-4


def test_nf4_experts_train_in_bf16_mixed_on_cuda(mixture, tmp_path, chat_data):
    from helpers import ROOT

    args = ["train", str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"), f"model.source={mixture}"]
    args += [f"data.source={chat_data}", "model.device=cuda", "model.quantize=nf4", "train.precision=bf16-mixed"]
    args += ["lora.targets=[q,v,experts]", "train.max_steps=3", f"output.dir={tmp_path / 'run'}"]
    assert main(args) == 0


def test_gemma3_greedy_on_cuda_equals_transformers(tmp_path):
    folder = build_checkpoint(tmp_path / "g", family="gemma3_text", **GEMMA3)
    prompt = token_ids(1, 9, 7)[0].tolist()
    ours = generate(load_model(folder, device="cuda"), prompt, max_new_tokens=24)  # past the window of 8
    ref = (
        hf_model(folder)
        .cuda()
        .generate(torch.tensor([prompt]).cuda(), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    )
    assert ours == ref[0, len(prompt) :].tolist()
