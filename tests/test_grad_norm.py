"""metrics.jsonl's grad_norm: the adapters' global gradient norm before clipping, as torch's clip_grad_norm_ computes
it and the HF Trainer logs it."""

import pytest
import torch
from test_train import chat_file, metrics, recipe

from lora_llama import load_model
from lora_llama.training.from_recipe import train_from_recipe
from lora_llama.training.trainer import Trainer


@pytest.mark.parametrize("max_norm", [1e9, 1e-3])
def test_grad_norm_is_the_global_norm_before_clipping_and_the_update_sees_it_clipped(tiny_ckpt, tmp_path, max_norm):
    from lora_llama import apply_lora, load_tokenizer
    from lora_llama.data.sft import build_examples

    r = recipe(tiny_ckpt, chat_file(tmp_path / "d.jsonl"), tmp_path / "run", f"train.max_grad_norm={max_norm}")
    tok = load_tokenizer(tiny_ckpt)
    train, val = build_examples(r.data, tok, 0)
    model = load_model(tiny_ckpt)
    apply_lora(model, r.lora)
    (tmp_path / "run").mkdir()
    trainer = Trainer(r, model, tok, train, val, tmp_path / "run")
    raw, clipped = [], []
    params = [p for p in model.parameters() if p.requires_grad]
    clip = torch.nn.utils.clip_grad_norm_

    def seen_then_clipped(ps, n):
        raw.append([p.grad.clone() for p in ps])
        return clip(ps, n)

    with pytest.MonkeyPatch.context() as m:  # the gradients as the step made them, then as the optimizer gets them
        m.setattr(torch.nn.utils, "clip_grad_norm_", seen_then_clipped)
        m.setattr(trainer.optimizer, "step", lambda: clipped.append([p.grad.clone() for p in params]))
        stats = trainer.train_step()[2]
    by_hand = sum(float(g.double().pow(2).sum()) for g in raw[0]) ** 0.5
    assert by_hand > 1e-3  # B is zero, A's gradient is too; the norm is of the B gradients
    assert float(stats["grad_norm"]) == pytest.approx(by_hand, rel=1e-5)  # float32 sums of ~1e4 squares
    after = sum(float(g.double().pow(2).sum()) for g in clipped[0]) ** 0.5
    assert after == pytest.approx(min(by_hand, max_norm), rel=1e-5)


def test_metrics_lines_carry_grad_norm_when_clipping_and_not_without(tiny_ckpt, tmp_path):
    data = chat_file(tmp_path / "d.jsonl")
    for norm, out in (("1.0", tmp_path / "a"), ("null", tmp_path / "b")):
        r = recipe(tiny_ckpt, data, out, "train.max_steps=2", f"train.max_grad_norm={norm}")
        train_from_recipe(r, log=lambda *_: None)
        steps = [m for m in metrics(out) if "loss" in m]
        assert len(steps) == 2
        assert all((m.get("grad_norm", 0) > 0) if norm == "1.0" else "grad_norm" not in m for m in steps)
