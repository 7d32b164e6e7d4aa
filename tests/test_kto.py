"""KTO against trl's KTOTrainer (same model, adapter, batch and precision), its data, and its recipe through
lora-llama train on one process and on two."""

import json

import pytest
import torch
from test_preference import assert_same_grads, ours_with_random_adapter, trl_trainer

import helpers
from helpers import PREFERENCE_ROWS, preference_file
from lora_llama.cli import main
from lora_llama.data.records import Skipped
from lora_llama.loading.adapters import save_adapter
from lora_llama.loading.models import load_tokenizer
from lora_llama.objectives.kto import KTO, KTOSettings, tokenize_unpaired, with_mismatched
from lora_llama.runtime.distributed import Ranks


def unpaired_records():
    """Each pair as two rows, desirable then undesirable, in trl's conversational form."""
    rows = []
    for p, c, r in PREFERENCE_ROWS:
        for answer, label in ((c, True), (r, False)):
            rows.append(
                {
                    "prompt": [{"role": "user", "content": p}],
                    "completion": [{"role": "assistant", "content": answer}],
                    "label": label,
                }
            )
    return rows


def toward_the_completions(model, examples, tok):
    """The adapter after a few SFT steps on the completions: the policy then likes them more than the base does,
    with the mismatched prompts too, so that the KL estimate is positive (a negative one is clamped to 0)."""
    from lora_llama.objectives.sft import SFT

    sft = SFT()
    batch = sft.collate([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples], tok.pad_token_id)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    for _ in range(3):
        (loss,), _ = sft.terms(model, batch)
        (loss / sft.counts(batch)[0]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33)])
def test_kto_first_step_equals_trl(preference_ckpt, tmp_path, weights):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    tok = load_tokenizer(str(preference_ckpt))
    records = unpaired_records()
    examples, skipped = tokenize_unpaired(Dataset.from_list(records), tok, 128)
    assert len(examples) == 8 and not skipped
    model = toward_the_completions(ours_with_random_adapter(preference_ckpt, tmp_path), examples, tok)
    save_adapter(model, tmp_path / "adapter", base_model=str(preference_ckpt), force=True)
    desirable, undesirable = weights
    args = KTOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=0.25,
        desirable_weight=desirable,
        undesirable_weight=undesirable,
        per_device_train_batch_size=4,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=None,
    )
    trainer = trl_trainer(KTOTrainer, args, preference_ckpt, records, tok, tmp_path / "adapter")
    # the same token ids: the prompt through the chat template with the generation prompt, then the completion
    for ex, row in zip(examples, trainer.train_dataset):
        assert ex["input_ids"] == row["prompt_ids"] + row["completion_ids"]
        assert ex["prompt_len"] == len(row["prompt_ids"]) and ex["label"] == row["label"]

    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    their_loss = trainer.compute_loss(trainer.model, batch)
    their_loss.backward()
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    objective = KTO(KTOSettings(beta=0.25, desirable_weight=desirable, undesirable_weight=undesirable))
    first = with_mismatched(examples, 4, 128)[:4]  # runs of 4: trl's per_device_train_batch_size
    (ours_batch,) = objective.prepare(model, [objective.collate(first, tok.pad_token_id)], 0, Ranks())
    (n,) = objective.counts(ours_batch)
    terms, stats = objective.terms(model, ours_batch)
    loss = terms[0] / n
    loss.backward()
    ours = objective.summarize(stats, [n], Ranks())
    assert n == 4 and abs(float(loss) - float(their_loss)) < 1e-5
    assert ours["kl"] > 0 and abs(ours["kl"] - theirs["kl"]) < 1e-5  # the adapter moved the policy: a KL to match
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert abs(ours[k] - theirs[k]) < 1e-5 * max(1.0, abs(theirs[k])), k
    assert_same_grads(model, trainer.model)


def test_unpaired_data_reads_pairs_as_trl_does_and_skips_a_bad_label(preference_ckpt):
    from datasets import Dataset

    from lora_llama.errors import UserError

    tok = load_tokenizer(str(preference_ckpt))
    pairs = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PREFERENCE_ROWS]
    flat = [{"prompt": p, "completion": a, "label": lab} for p, c, r in PREFERENCE_ROWS for a, lab in ((c, 1), (r, 0))]
    from_pairs, _ = tokenize_unpaired(Dataset.from_list(pairs), tok, 128)
    from_rows, _ = tokenize_unpaired(Dataset.from_list([{**f, "label": bool(f["label"])} for f in flat]), tok, 128)
    assert from_pairs == from_rows and [e["label"] for e in from_pairs] == [True, False] * 4
    examples, skipped = tokenize_unpaired(Dataset.from_list(flat), tok, 128)
    assert not examples and list(skipped.rows) == [
        "a 'label' that is not true or false (1)",
        "a 'label' that is not true or false (0)",
    ]
    with pytest.raises(UserError, match="row 1: a 'label' that is not true or false"):
        tokenize_unpaired(Dataset.from_list(flat), tok, 128, skipped=Skipped("feedback.jsonl", strict=True))


def kto_args(ckpt, data, out, *extra):
    """The shipped KTO recipe on the tiny checkpoint and a few pairs."""
    return [
        "train",
        str(helpers.ROOT / "recipes" / "smollm2-kto-cpu.yaml"),
        f"model.source={ckpt}",
        f"data.source={data}",
        f"output.dir={out}",
        "data.val_size=0.25",
        "train.max_steps=20",
        "train.warmup_steps=0",
        "train.lr=5e-3",
        "train.batch_size=4",
        "train.eval_every=20",
        "train.save_every=10",
        "lora.targets=[q,k,v,o,gate,up,down]",
        *extra,
    ]


def test_kto_recipe_trains_and_its_adapter_opens_in_peft(preference_ckpt, tmp_path):
    data = preference_file(tmp_path / "pairs.jsonl", PREFERENCE_ROWS * 4)
    out = tmp_path / "run"
    assert main(kto_args(preference_ckpt, data, out)) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps, evals = [m for m in rows if "loss" in m], [m for m in rows if "eval_loss" in m]
    assert len(steps) == 20 and {"kl", "rewards/chosen", "rewards/margins"} <= set(steps[0])
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(helpers.hf_model(preference_ckpt), out / "adapter")
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in peft_model.named_parameters())
