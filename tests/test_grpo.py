"""GRPO: the loss and its gradients against trl's GRPOTrainer on the same model and tokens (per loss type, with
and without the KL term), advantages by hand, batched sampling against transformers' generate."""

import math

import pytest
import torch

from helpers import ALL, hf_model, make_tokenizer, random_lora_b
from lora_llama import LoraSettings, apply_lora, load_model, save_adapter
from lora_llama.labels import IGNORE_INDEX
from lora_llama.model.generate import sample_completions
from lora_llama.objectives.grpo.objective import GRPO, GRPOSettings
from lora_llama.objectives.grpo.rewards import group_advantages


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def test_batched_sampling_equals_transformers_greedy_on_left_padded_prompts(tiny_ckpt):
    model, ref = load_model(tiny_ckpt), hf_model(tiny_ckpt)
    prompts = prompts_of((3, 7, 5, 1))
    ours = sample_completions(model, prompts, 10, eos_ids=[], pad_id=0, temperature=0)
    width = max(map(len, prompts))
    ids, mask = torch.zeros(4, width, dtype=torch.long), torch.zeros(4, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert ours == want[:, width:].tolist()


def test_a_sampled_completion_depends_on_its_seed_not_on_its_batch(tiny_ckpt):
    model = load_model(tiny_ckpt)
    prompts = prompts_of((3, 7, 5, 2), seed=1)
    together = sample_completions(model, prompts, 12, eos_ids=[], pad_id=0, temperature=1.0, seeds=[1, 2, 3, 4])
    apart = sample_completions(model, prompts[2:], 12, eos_ids=[], pad_id=0, temperature=1.0, seeds=[3, 4])
    again = sample_completions(model, prompts[:1] * 2, 12, eos_ids=[], pad_id=0, temperature=1.0, seeds=[1, 9])
    assert together[2:] == apart and again[0] == together[0] and again[1] != again[0]


def test_a_group_runs_its_prompt_once_and_samples_as_rows_do(tiny_ckpt):
    model = load_model(tiny_ckpt)
    prompts = [p for p in prompts_of((3, 6), seed=2) for _ in range(3)]
    seeds = list(range(6))
    alone = sample_completions(model, prompts, 10, eos_ids=[], pad_id=0, temperature=1.0, seeds=seeds)
    grouped = sample_completions(model, prompts, 10, eos_ids=[], pad_id=0, temperature=1.0, seeds=seeds, group=3)
    assert grouped == alone and len({tuple(c) for c in grouped[:3]}) > 1


def test_sampling_stops_each_row_at_its_eos(tiny_ckpt):
    model = load_model(tiny_ckpt)
    free = sample_completions(model, prompts_of((4, 4)), 12, eos_ids=[], pad_id=0, temperature=0)
    stop = free[0][3]  # the token row 0 produces fourth
    cut = sample_completions(model, prompts_of((4, 4)), 12, eos_ids=[stop], pad_id=0, temperature=0)
    assert cut[0] == free[0][: free[0].index(stop) + 1]
    assert cut[1] == (free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1])


def test_rows_decode_on_while_another_rank_says_so_and_come_out_the_same(tiny_ckpt):
    """fsdp: a rank whose rows are done keeps running forwards until every rank is; its completions do not change."""
    model = load_model(tiny_ckpt)
    prompts = prompts_of((4, 5), seed=3)
    free = sample_completions(model, prompts, 12, eos_ids=[], pad_id=0, temperature=0)
    stop = [free[0][1], free[1][1]]  # both rows end on their second token
    calls = []

    def other_rank(mine):
        return calls.append(mine) or len(calls) < 6  # "another rank still decodes", 5 times

    alone = sample_completions(model, prompts, 12, eos_ids=stop, pad_id=0, temperature=0)
    synced = sample_completions(model, prompts, 12, eos_ids=stop, pad_id=0, temperature=0, any_rank=other_rank)
    assert synced == alone and all(len(c) <= 2 for c in alone)
    assert len(calls) == 6 and calls[2:] == [False] * 4  # asked each step; this rank was done from the second


def test_advantages_by_hand():
    nan = math.nan
    rewards = torch.tensor([1.0, 2.0, 3.0, nan, 5.0, 5.0, 5.0, 5.0])
    group = group_advantages(rewards, 4, "group")
    # group 1: mean 2 and std 1 over the three scored rows; the unscorable row gets 0; group 2: no spread
    assert torch.allclose(group, torch.tensor([-1, 0, 1, 0, 0, 0, 0, 0]) / (1 + 1e-4))
    none = group_advantages(rewards, 4, "none")
    assert torch.allclose(none, torch.tensor([-1.0, 0, 1, 0, 0, 0, 0, 0]))
    kept = torch.tensor([1.0, 2, 3, 5, 5, 5, 5])
    batch_std = float(kept.std())
    assert torch.allclose(group_advantages(rewards, 4, "batch"), none / (batch_std + 1e-4))


# ------------------------------------------------------------------------ against trl


def _policy(ckpt, folder):
    """Our model with LoRA (B non-zero, so the adapter matters), saved for peft."""
    model = load_model(ckpt)
    torch.manual_seed(0)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    random_lora_b(model, seed=1)
    save_adapter(model, folder)
    return model


def _trl_trainer(ckpt, adapter, folder, settings):
    from datasets import Dataset
    from peft import PeftModel
    from trl import GRPOConfig, GRPOTrainer

    peft_model = PeftModel.from_pretrained(hf_model(ckpt), adapter, is_trainable=True)
    cfg = GRPOConfig(
        output_dir=str(folder),
        per_device_train_batch_size=4,
        num_generations=settings.group_size,
        max_completion_length=settings.max_new_tokens,
        loss_type=settings.loss_type,
        beta=settings.beta,
        epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        temperature=settings.temperature,
        use_bias_correction_kl=settings.use_bias_correction_kl,
        importance_sampling_level=settings.importance_sampling_level,
        delta=settings.delta,
        sapo_temperature_pos=settings.sapo_temperature_pos,
        sapo_temperature_neg=settings.sapo_temperature_neg,
        vespo_k_pos=settings.vespo_k_pos,
        vespo_lambda_pos=settings.vespo_lambda_pos,
        vespo_k_neg=settings.vespo_k_neg,
        vespo_lambda_neg=settings.vespo_lambda_neg,
        top_entropy_quantile=settings.top_entropy_quantile,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=peft_model,
        reward_funcs=[lambda prompts, completions, **_: [0.0] * len(prompts)],
        args=cfg,
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 4),
        processing_class=make_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _rollout_batch(prompts, completions, advantages):
    """Our training rows: prompt + completion, the completion's tokens the targets."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
    return {
        "input_ids": ids,
        "labels": labels,
        "advantages": advantages,
        "completions": torch.tensor(len(prompts)),
        "completion": torch.arange(len(prompts))[:, None].expand_as(ids).clone(),
    }


def _trl_inputs(prompts, completions, advantages, max_new):
    """trl's: prompts left-padded, completions right-padded to max_new, with their masks."""
    width = max(map(len, prompts))
    prompt_ids, prompt_mask = (
        torch.zeros(len(prompts), width, dtype=torch.long),
        torch.zeros(len(prompts), width, dtype=torch.long),
    )
    comp_ids, comp_mask = (
        torch.zeros(len(prompts), max_new, dtype=torch.long),
        torch.zeros(len(prompts), max_new, dtype=torch.long),
    )
    for i, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[i, width - len(p) :], prompt_mask[i, width - len(p) :] = torch.tensor(p), 1
        comp_ids[i, : len(c)], comp_mask[i, : len(c)] = torch.tensor(c), 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": comp_ids,
        "completion_mask": comp_mask,
        "advantages": advantages,
        "num_items_in_batch": comp_mask.sum(),
    }


@pytest.mark.parametrize(
    "loss_type,beta,correction,options",
    [
        ("dapo", 0.0, True, {}),
        ("grpo", 0.0, True, {}),
        ("bnpo", 0.0, True, {}),
        ("dr_grpo", 0.0, True, {}),
        ("dapo", 0.04, True, {}),
        ("grpo", 0.04, True, {}),
        ("bnpo", 0.04, False, {}),
        ("cispo", 0.0, True, {"epsilon_high": 0.3}),
        ("cispo", 0.04, True, {"epsilon_high": 0.3}),
        ("sapo", 0.0, True, {}),
        ("sapo", 0.04, True, {"sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.3}),
        ("luspo", 0.0, True, {"importance_sampling_level": "sequence"}),
        ("luspo", 0.04, True, {"importance_sampling_level": "sequence"}),
        ("grpo", 0.0, True, {"importance_sampling_level": "sequence"}),  # GSPO
        ("grpo", 0.04, True, {"importance_sampling_level": "sequence"}),
        ("vespo", 0.0, True, {}),
        ("vespo", 0.04, True, {"vespo_k_pos": 1.5, "vespo_lambda_neg": 2.5}),
        ("dapo", 0.0, True, {"delta": 1.1}),
        ("dapo", 0.0, True, {"top_entropy_quantile": 0.5}),
        ("grpo", 0.04, True, {"top_entropy_quantile": 0.3}),
        ("cispo", 0.0, True, {"top_entropy_quantile": 0.8, "epsilon_high": 0.3}),
        ("grpo", 0.04, True, {"delta": 1.05}),
    ],
)
def test_loss_and_gradients_equal_trl(tiny_ckpt, tmp_path, loss_type, beta, correction, options):
    """trl 1.16's GRPOTrainer._compute_loss is the reference, for each loss type, the sequence-level ratio (GSPO) and
    two-sided clipping (delta)."""
    settings = GRPOSettings(
        **{
            "group_size": 4,
            "max_new_tokens": 9,
            "loss_type": loss_type,
            "beta": beta,
            "epsilon": 0.2,
            "epsilon_high": 0.28,
            "temperature": 0.7,
            "rewards": ["format"],
            "use_bias_correction_kl": correction,
            **options,
        }
    )
    model = _policy(tiny_ckpt, tmp_path / "a")
    prompts = prompts_of((3, 5, 5, 2), seed=3)
    completions = prompts_of((9, 4, 7, 1), seed=4)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.0])
    ours = GRPO(settings, make_tokenizer(), [2], seed=0)
    batch = _rollout_batch(prompts, completions, advantages)
    # an older policy: the ratio moves off 1 and both clips engage
    from lora_llama.objectives.token_losses import token_logps

    with torch.no_grad():
        now = token_logps(model, batch["input_ids"], batch["labels"], 0.7)[0]
        batch["old_logps"] = now + torch.linspace(-0.4, 0.4, now.numel())
    model.train()
    terms, stats = ours.terms(model, batch)
    loss = terms[0] / ours.counts(batch)[0]
    loss.backward()

    trainer = _trl_trainer(tiny_ckpt, tmp_path / "a", tmp_path / "trl", settings)
    inputs = _trl_inputs(prompts, completions, advantages, settings.max_new_tokens)
    mask = inputs["completion_mask"].bool()
    inputs["old_per_token_logps"] = torch.zeros(mask.shape).masked_scatter(mask, batch["old_logps"])
    if beta:
        from lora_llama.lora.adapted import adapters_disabled

        with torch.no_grad(), adapters_disabled(model):
            ref = token_logps(model, batch["input_ids"], batch["labels"], 0.7)[0]
        inputs["ref_per_token_logps"] = torch.zeros(mask.shape).masked_scatter(mask, ref)
    trainer.model.train()
    want = trainer._compute_loss(trainer.model, inputs)
    want.backward()
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-5, (float(loss.detach()), float(want.detach()))
    if settings.importance_sampling_level == "token":  # the ratio moved past both clip bounds
        assert stats["clip_ratio/low_mean"] > 0 and stats["clip_ratio/high_mean"] > 0
    trl_grads = {
        n.replace("base_model.model.", "").replace(".default", ""): p.grad
        for n, p in trainer.model.named_parameters()
        if p.grad is not None
    }
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(trl_grads) and len(grads) == 28
    for k in grads:
        assert torch.allclose(grads[k], trl_grads[k], atol=1e-5, rtol=1e-4), k


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"])
def test_packed_completions_train_as_separate_rows(tiny_ckpt, tmp_path, loss_type):
    """data.packing: several completions to a row, each attending to itself; loss and gradients unchanged."""
    settings = GRPOSettings(group_size=2, max_new_tokens=9, loss_type=loss_type, beta=0.04, rewards=["format"])
    prompts, completions = prompts_of((3, 5, 5, 2), seed=3), prompts_of((9, 4, 7, 1), seed=4)
    examples = [{"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + c} for p, c in zip(prompts, completions)]
    results = []
    for packing in (False, True):
        model = _policy(tiny_ckpt, tmp_path / str(packing))
        grpo = GRPO(settings, make_tokenizer(), [2], seed=0, packing=packing, max_seq_len=24)
        batch = grpo.rollouts.rows(examples)
        batch["advantages"] = torch.tensor([1.3, -0.7, 0.4, -1.0])
        model.train()
        terms, _ = grpo.terms(model, batch)
        (terms[0] / grpo.counts(batch)[0]).backward()
        results.append(
            (
                batch["input_ids"].shape[0],
                float(terms[0].detach()) / grpo.counts(batch)[0],
                {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    (rows, loss, grads), (packed_rows, packed_loss, packed_grads) = results
    assert packed_rows < rows and abs(loss - packed_loss) < 1e-5
    assert all(torch.allclose(grads[k], packed_grads[k], atol=1e-5, rtol=1e-4) for k in grads)


def test_an_environment_is_the_reward_unless_rewards_are_given():
    """train.grpo.rewards defaults to reasoning_gym, except beside an environment, whose get_reward() scores."""
    from lora_llama.recipe.schema import load_recipe

    grpo = ["train.objective=grpo", "data.format=prompt"]
    environment = "train.grpo.environment=recipes/tools/calculator.py:Calculator"
    assert load_recipe(None, grpo).train.grpo.rewards == ["reasoning_gym"]
    assert load_recipe(None, [*grpo, environment]).train.grpo.rewards == []
    assert load_recipe(None, [*grpo, environment, "train.grpo.rewards=[format]"]).train.grpo.rewards == ["format"]
