"""Preference tuning: DPO and ORPO against trl (same model, adapter, data and precision), the reference pass,
preference data, and the trainer with train.objective dpo / orpo."""

import pytest
import torch

import helpers
from helpers import preference_records
from lora_llama import load_model
from lora_llama.data.preference import collate_pairs, tokenize_pairs
from lora_llama.data.records import Skipped
from lora_llama.loading.adapters import save_adapter
from lora_llama.loading.models import load_tokenizer
from lora_llama.lora.adapted import adapters_disabled, apply_lora, lora_modules
from lora_llama.lora.settings import lora_settings
from lora_llama.model.config import BLOCK_LINEARS, LINEAR_NAMES
from lora_llama.objectives.dpo import DPO, DPOSettings
from lora_llama.objectives.orpo import ORPO, ORPOSettings
from lora_llama.recipe.schema import DataSection


def ours_with_random_adapter(folder, tmp_path):
    """Our model with LoRA on all seven linears and a non-zero B (so that rewards are not all zero), and the
    same adapter saved in the PEFT format for trl's model."""
    model = load_model(folder)
    apply_lora(model, lora_settings(r=4, alpha=8, targets=list(BLOCK_LINEARS)))
    torch.manual_seed(3)
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.05)
    save_adapter(model, tmp_path / "adapter", base_model=str(folder))
    return model


def load_into(peft_model, adapter_dir):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(peft_model, load_file(adapter_dir / "adapter_model.safetensors"))
    assert not result.unexpected_keys


def trl_trainer(trainer_class, args, preference_ckpt, records, tok, adapter):
    """trl's trainer of `trainer_class` on the checkpoint through peft, holding our saved adapter."""
    from datasets import Dataset
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules=[LINEAR_NAMES[t] for t in BLOCK_LINEARS], lora_dropout=0.0)
    trainer = trainer_class(
        model=helpers.hf_model(preference_ckpt),
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
        peft_config=config,
    )
    load_into(trainer.model, adapter)
    return trainer


def lora_grads_by_peft_name(peft_model):
    return {
        n.replace("base_model.model.", "").replace(".default", ""): p.grad
        for n, p in peft_model.named_parameters()
        if "lora_" in n
    }


def assert_same_grads(model, peft_model):
    theirs = lora_grads_by_peft_name(peft_model)
    ours = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert len(ours) == len(theirs) == 2 * 7 * 2
    for name, g in ours.items():
        assert torch.allclose(g, theirs[name], atol=1e-5, rtol=1e-4), (name, (g - theirs[name]).abs().max())


def test_dpo_first_step_equals_trl(preference_ckpt, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = load_tokenizer(str(preference_ckpt))
    pairs, skipped = tokenize_pairs(Dataset.from_list(preference_records(False)), tok, DataSection(max_seq_len=128))
    assert len(pairs) == 4 and not skipped
    model = ours_with_random_adapter(preference_ckpt, tmp_path)

    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=0.1,
        loss_type=["sigmoid"],
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=None,
        dataloader_drop_last=False,
    )
    trainer = trl_trainer(DPOTrainer, args, preference_ckpt, preference_records(True), tok, tmp_path / "adapter")
    # the same token ids: prompt through the chat template with the generation prompt, then the answer
    for pair, row in zip(pairs, trainer.train_dataset):
        assert pair["chosen"]["input_ids"] == row["prompt_ids"] + row["chosen_ids"]
        assert pair["rejected"]["input_ids"] == row["prompt_ids"] + row["rejected_ids"]
        assert pair["chosen"]["prompt_len"] == len(row["prompt_ids"])

    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    their_loss = trainer.compute_loss(trainer.model, batch)
    their_loss.backward()
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    objective = DPO(DPOSettings(beta=0.1))
    ours_batch = collate_pairs(pairs, tok.pad_token_id)
    (n_pairs,) = objective.counts(ours_batch)
    terms, stats = objective.terms(model, ours_batch)
    loss = terms[0] / n_pairs
    loss.backward()
    assert abs(float(loss) - float(their_loss)) < 1e-5
    assert abs(float(loss) - 0.6931) > 1e-3  # the adapter moved the policy off the reference
    for k in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        assert abs(stats[k] / n_pairs - theirs[k]) < 1e-5 * max(1.0, abs(theirs[k])), k
    assert_same_grads(model, trainer.model)


def test_orpo_first_step_equals_trl(preference_ckpt, tmp_path):
    """On trl's own batch (its ORPO tokenizer adds BOS and EOS its own way): loss, rewards and gradients, with
    train_on_prompt as trl's NLL covers the prompt too."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tok = load_tokenizer(str(preference_ckpt))
    model = ours_with_random_adapter(preference_ckpt, tmp_path)
    args = ORPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=0.25,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=128,
    )
    trainer = trl_trainer(ORPOTrainer, args, preference_ckpt, preference_records(True), tok, tmp_path / "adapter")
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    their_loss, theirs = trainer.get_batch_loss_metrics(trainer.model, batch)
    their_loss.backward()

    # the same rows as one of our batches: chosen then rejected, prompt_len = the masked prompt
    rows = []
    for side in ("chosen", "rejected"):
        for ids, mask, labels in zip(
            batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"], batch[f"{side}_labels"]
        ):
            n = int(mask.sum())
            rows.append(
                {
                    "input_ids": ids[:n].tolist(),
                    "labels": ids[:n].tolist(),
                    "prompt_len": int((labels[:n] == -100).sum()),
                }
            )
    half = len(rows) // 2
    ours_batch = collate_pairs(
        [{"chosen": c, "rejected": r} for c, r in zip(rows[:half], rows[half:])], tok.pad_token_id
    )
    objective = ORPO(ORPOSettings(beta=0.25))
    counts = objective.counts(ours_batch)
    terms, stats = objective.terms(model, ours_batch)
    loss = sum(t / n for t, n in zip(terms, counts))
    loss.backward()
    assert abs(float(loss) - float(their_loss)) < 1e-5
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert abs(stats[k] / counts[0] - float(theirs[k])) < 1e-5, k
    assert_same_grads(model, trainer.model)


def test_ipo_is_the_squared_per_token_margin(preference_ckpt, tmp_path):
    """IPO by hand: ((π_c - ref_c)/n_c - (π_r - ref_r)/n_r - 1/(2β))², the log-probs from plain log_softmax."""
    from datasets import Dataset

    tok = load_tokenizer(str(preference_ckpt))
    pairs, _ = tokenize_pairs(Dataset.from_list(preference_records(False)[:2]), tok, DataSection(max_seq_len=128))
    model = ours_with_random_adapter(preference_ckpt, tmp_path)
    batch = collate_pairs(pairs, tok.pad_token_id)

    def logps_by_hand():
        logits = model(batch["input_ids"]).float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        answer = torch.arange(1, lp.shape[1] + 1)[None] >= batch["prompt_lens"][:, None]
        answer &= batch["labels"][:, 1:] != -100
        return (lp * answer).sum(1), answer.sum(1)

    with torch.no_grad():
        policy, n = logps_by_hand()
        with adapters_disabled(model):
            ref, _ = logps_by_hand()
    c, r = ((policy - ref) / n).chunk(2)
    expected = ((c - r - 1 / (2 * 0.5)) ** 2).sum()
    terms, _ = DPO(DPOSettings(beta=0.5, loss="ipo")).terms(model, batch)
    assert torch.allclose(terms[0], expected, rtol=1e-5, atol=1e-6)


def test_reference_pass_keeps_no_graph_and_no_gradient_buffers(preference_ckpt, tmp_path):
    from datasets import Dataset

    tok = load_tokenizer(str(preference_ckpt))
    pairs, _ = tokenize_pairs(Dataset.from_list(preference_records(False)), tok, DataSection(max_seq_len=128))
    model = ours_with_random_adapter(preference_ckpt, tmp_path)
    batch = collate_pairs(pairs, tok.pad_token_id)
    saved = []

    def count(t):
        saved.append(t.numel() * t.element_size())
        return t

    from lora_llama.objectives.token_losses import answer_logps

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        with torch.no_grad(), adapters_disabled(model):
            ref = answer_logps(model, batch)[0]
        assert saved == [] and not ref.requires_grad
        policy = answer_logps(model, batch)[0]
    assert sum(saved) > 0 and policy.requires_grad  # the policy pass does keep its activations
    assert all(p.grad is None for p in model.parameters())


def test_preference_data_bad_and_skipped_records(preference_ckpt, tmp_path):
    from datasets import Dataset

    from lora_llama.errors import UserError

    tok = load_tokenizer(str(preference_ckpt))
    ok = {"prompt": "hello", "chosen": "world", "rejected": "dog"}
    pairs, skipped = tokenize_pairs(
        Dataset.from_list([ok, {**ok, "chosen": "  "}, {**ok, "prompt": "hello " * 80}]),
        tok,
        DataSection(max_seq_len=32),
    )
    assert len(pairs) == 1 and len(skipped) == 2
    assert any("empty" in why for why in skipped.rows) and any("max_seq_len" in why for why in skipped.rows)
    pairs, skipped = tokenize_pairs(
        Dataset.from_list([ok, {"prompt": "a", "chosen": "b", "rejected": None}]), tok, DataSection(max_seq_len=32)
    )
    assert len(pairs) == 1 and skipped.rows == {"a null 'rejected'": [2]}  # rows counted from 1
    with pytest.raises(UserError, match="data the data: row 2: a null 'rejected'"):
        tokenize_pairs(
            Dataset.from_list([ok, {**ok, "rejected": None}]),
            tok,
            DataSection(max_seq_len=32),
            skipped=Skipped("the data", True),
        )
    pairs, _ = tokenize_pairs(
        Dataset.from_list([{"q": "hello", "good": "world", "bad": "dog"}]),
        tok,
        DataSection(max_seq_len=32, fields={"prompt": "q", "chosen": "good", "rejected": "bad"}),
    )
    assert len(pairs) == 1
