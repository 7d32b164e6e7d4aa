"""Preference tuning: DPO and ORPO against trl (same model, adapter, data and precision), the reference pass,
preference data, and the trainer with train.objective dpo / orpo."""

import json

import pytest
import torch

import helpers
from lora_llama import load_model
from lora_llama.cli import main
from lora_llama.data.preference import collate_pairs, tokenize_pairs
from lora_llama.loading.adapters import save_adapter
from lora_llama.loading.models import load_tokenizer
from lora_llama.lora.adapted import adapters_disabled, apply_lora, lora_modules
from lora_llama.lora.settings import lora_settings
from lora_llama.model.config import DECODER_TARGETS, HF_NAME
from lora_llama.recipe.schema import load_recipe
from lora_llama.training.objectives import DPO, ORPO

ROWS = [
    ("what is the capital of france?", "paris is.", "the lazy dog"),
    ("hello world", "how are you today? i am fine.", "to be"),
    ("the quick brown fox", "jumps over the lazy dog", "what is the question"),
    ("to be or not to be", "that is the question", "hello"),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny checkpoint with a tokenizer that adds no BOS: trl's chat tokenization adds none, ours adds the
    tokenizer's own, so without one both give the same ids."""
    from tokenizers import processors

    folder = helpers.build_checkpoint(tmp_path_factory.mktemp("pref"))
    tok = helpers.make_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    tok.save_pretrained(folder)
    return folder


def records(conversational: bool):
    if not conversational:
        return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS]
    return [
        {
            "prompt": [{"role": "user", "content": p}],
            "chosen": [{"role": "assistant", "content": c}],
            "rejected": [{"role": "assistant", "content": r}],
        }
        for p, c, r in ROWS
    ]


def ours_with_random_adapter(folder, tmp_path):
    """Our model with LoRA on all seven linears and a non-zero B (so that rewards are not all zero), and the
    same adapter saved in the PEFT format for trl's model."""
    model = load_model(folder)
    apply_lora(model, lora_settings(r=4, alpha=8, targets=list(DECODER_TARGETS)))
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


def test_dpo_first_step_equals_trl(base, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    tok = load_tokenizer(str(base))
    pairs, skipped = tokenize_pairs(Dataset.from_list(records(False)), tok, 128)
    assert len(pairs) == 4 and not skipped
    model = ours_with_random_adapter(base, tmp_path)

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
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[HF_NAME[t] for t in DECODER_TARGETS], lora_dropout=0.0)
    trainer = DPOTrainer(
        model=helpers.hf_model(base),
        args=args,
        train_dataset=Dataset.from_list(records(True)),
        processing_class=tok,
        peft_config=config,
    )
    load_into(trainer.model, tmp_path / "adapter")
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

    objective = DPO(beta=0.1)
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


def test_orpo_first_step_equals_trl(base, tmp_path):
    """On trl's own batch (its ORPO tokenizer adds BOS and EOS its own way): loss, rewards and gradients, with
    train_on_prompt as trl's NLL covers the prompt too."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tok = load_tokenizer(str(base))
    model = ours_with_random_adapter(base, tmp_path)
    args = ORPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=0.25,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=128,
    )
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[HF_NAME[t] for t in DECODER_TARGETS], lora_dropout=0.0)
    trainer = ORPOTrainer(
        model=helpers.hf_model(base),
        args=args,
        train_dataset=Dataset.from_list(records(True)),
        processing_class=tok,
        peft_config=config,
    )
    load_into(trainer.model, tmp_path / "adapter")
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
    objective = ORPO(beta=0.25)
    counts = objective.counts(ours_batch)
    terms, stats = objective.terms(model, ours_batch)
    loss = sum(t / n for t, n in zip(terms, counts))
    loss.backward()
    assert abs(float(loss) - float(their_loss)) < 1e-5
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert abs(stats[k] / counts[0] - float(theirs[k])) < 1e-5, k
    assert_same_grads(model, trainer.model)


def test_ipo_is_the_squared_per_token_margin(base, tmp_path):
    """IPO by hand: ((π_c - ref_c)/n_c - (π_r - ref_r)/n_r - 1/(2β))², the log-probs from plain log_softmax."""
    from datasets import Dataset

    tok = load_tokenizer(str(base))
    pairs, _ = tokenize_pairs(Dataset.from_list(records(False)[:2]), tok, 128)
    model = ours_with_random_adapter(base, tmp_path)
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
    terms, _ = DPO(beta=0.5, loss="ipo").terms(model, batch)
    assert torch.allclose(terms[0], expected, rtol=1e-5, atol=1e-6)


def test_reference_pass_keeps_no_graph_and_no_gradient_buffers(base, tmp_path):
    from datasets import Dataset

    tok = load_tokenizer(str(base))
    pairs, _ = tokenize_pairs(Dataset.from_list(records(False)), tok, 128)
    model = ours_with_random_adapter(base, tmp_path)
    batch = collate_pairs(pairs, tok.pad_token_id)
    saved = []

    def count(t):
        saved.append(t.numel() * t.element_size())
        return t

    from lora_llama.training.objectives import answer_logps

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        with torch.no_grad(), adapters_disabled(model):
            ref = answer_logps(model, batch)[0]
        assert saved == [] and not ref.requires_grad
        policy = answer_logps(model, batch)[0]
    assert sum(saved) > 0 and policy.requires_grad  # the policy pass does keep its activations
    assert all(p.grad is None for p in model.parameters())


def test_preference_data_bad_and_skipped_records(base, tmp_path):
    from datasets import Dataset

    from lora_llama.errors import UserError

    tok = load_tokenizer(str(base))
    ok = {"prompt": "hello", "chosen": "world", "rejected": "dog"}
    pairs, skipped = tokenize_pairs(
        Dataset.from_list([ok, {**ok, "chosen": "  "}, {**ok, "prompt": "hello " * 80}]), tok, 32
    )
    assert len(pairs) == 1 and sum(skipped.values()) == 2
    assert any("empty" in why for why in skipped) and any("max_seq_len" in why for why in skipped)
    with pytest.raises(UserError, match="'rejected'"):
        tokenize_pairs(Dataset.from_list([{"prompt": "a", "chosen": "b"}]), tok, 32)
    pairs, _ = tokenize_pairs(
        Dataset.from_list([{"q": "hello", "good": "world", "bad": "dog"}]),
        tok,
        32,
        fields={"prompt": "q", "chosen": "good", "rejected": "bad"},
    )
    assert len(pairs) == 1


def preference_file(path, rows):
    path.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in rows))
    return path


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_trainer_raises_reward_accuracy_and_margin(objective, base, tmp_path):
    data = preference_file(tmp_path / "pairs.jsonl", ROWS * 2)
    out = tmp_path / "run"
    r = load_recipe(
        None,
        [
            f"model.source={base}",
            f"data.source={data}",
            "data.format=preference",
            f"train.objective={objective}",
            f"output.dir={out}",
            "data.val_size=0.25",
            "train.max_steps=30",
            "train.warmup_steps=0",
            "train.lr=5e-3",
            "train.batch_size=2",
            "train.eval_every=30",
            "train.save_every=100",
            "lora.targets=[q,k,v,o,gate,up,down]",
        ],
    )
    from lora_llama.training.from_recipe import train_from_recipe

    result = train_from_recipe(r, log=lambda *_: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "loss" in m]
    evals = [m for m in rows if "eval_loss" in m]
    assert len(steps) == 30 and {"rewards/margins", "rewards/accuracies"} <= set(steps[0])
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 30
    assert evals[-1]["eval_rewards/accuracies"] > 0.5
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"]
    assert result["eval_loss"] < evals[0]["eval_loss"]
    assert (out / "loss.png").is_file() and (out / "adapter" / "adapter_model.safetensors").is_file()
    from lora_llama.outputs.hub import model_card

    card = model_card(out / "adapter", out, "me/pref")
    assert (
        f"| objective | {objective.upper()} (beta " in card and "reward accuracy" in card and f"- {objective}" in card
    )


@pytest.mark.parametrize(
    "override, message",
    [
        (["train.objective=dpo"], "needs data.format preference"),
        (["train.objective=dpo", "data.format=preference", "data.packing=true"], "packing is not supported"),
        (["data.format=preference"], "needs train.objective dpo or orpo"),
    ],
)
def test_bad_preference_recipes_exit_2(override, message, base, tmp_path, capsys):
    data = preference_file(tmp_path / "pairs.jsonl", ROWS)
    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {base}}}\ndata: {{source: {data}}}\noutput: {{dir: {out}}}\n")
    assert main(["train", str(recipe), *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_dpo_on_an_int8_base_uses_the_int8_base_as_reference(base, tmp_path):
    from datasets import Dataset

    from lora_llama.training.objectives import answer_logps

    tok = load_tokenizer(str(base))
    pairs, _ = tokenize_pairs(Dataset.from_list(records(False)), tok, 128)
    batch = collate_pairs(pairs, tok.pad_token_id)
    plain = load_model(base, quantize="int8")
    with torch.no_grad():
        expected = answer_logps(plain, batch)[0]
    model = load_model(base, quantize="int8")
    apply_lora(model, lora_settings(r=4, alpha=8, targets=["q", "v", "down"]))
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.05)
    with torch.no_grad(), adapters_disabled(model):
        assert torch.equal(answer_logps(model, batch)[0], expected)
    terms, stats = DPO(beta=0.1).terms(model, batch)
    terms[0].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
    assert stats["rewards/margins"] != 0
