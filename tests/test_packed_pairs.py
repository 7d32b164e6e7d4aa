"""Packed preference batches: a batch's chosen and rejected answers packed into rows, each attending to itself only,
give the loss, metrics and every LoRA gradient the unpacked batch gives (DPO's sigmoid and ipo, ORPO), on pairs of
mixed length (rejected answers 5-40 tokens, chosen 50-400), in fewer rows; and `lora-llama train` packs them."""

import json
import random

import pytest
import torch

from helpers import build_checkpoint
from lora_llama import load_model
from lora_llama.data.preference import collate_pairs
from lora_llama.lora.adapted import apply_lora, lora_modules
from lora_llama.lora.settings import lora_settings
from lora_llama.model.config import BLOCK_LINEARS
from lora_llama.objectives.dpo import DPO, DPOSettings
from lora_llama.objectives.orpo import ORPO, ORPOSettings


def mixed_pairs(n: int, seed: int = 0) -> list[dict]:
    """Tokenized pairs as build_pairs makes them: a short prompt, a chosen answer of 50-400 tokens and a rejected
    one of 5-40 (the prompt's tokens no targets)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = [rng.randrange(5, 300) for _ in range(rng.randrange(4, 12))]
        pair = {}
        for side, (low, high) in (("chosen", (50, 400)), ("rejected", (5, 40))):
            answer = [rng.randrange(5, 300) for _ in range(rng.randrange(low, high + 1))]
            pair[side] = {
                "input_ids": prompt + answer,
                "labels": [-100] * len(prompt) + answer,
                "prompt_len": len(prompt),
            }
        pairs.append(pair)
    return pairs


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("long"), max_position_embeddings=1024)


def adapted(ckpt):
    model = load_model(ckpt)
    apply_lora(model, lora_settings(r=4, alpha=8, targets=list(BLOCK_LINEARS)))
    torch.manual_seed(3)
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.05)
    return model


def step(objective, model, batch) -> tuple[list[float], dict, dict]:
    """(each loss term over its count, the metrics, every LoRA gradient) of one micro-batch."""
    model.zero_grad()
    counts = objective.counts(batch)
    terms, stats = objective.terms(model, batch)
    sum(t / max(c, 1) for t, c in zip(terms, counts)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [float(t.detach()) / max(c, 1) for t, c in zip(terms, counts)], stats, grads


@pytest.mark.parametrize(
    "objective",
    [DPO(DPOSettings(beta=0.1)), DPO(DPOSettings(beta=0.5, loss="ipo")), ORPO(ORPOSettings(beta=0.1))],
    ids=["dpo", "ipo", "orpo"],
)
def test_packed_pairs_train_as_the_unpacked_ones(objective, long_ckpt):
    model = adapted(long_ckpt)
    pairs = mixed_pairs(6)
    unpacked = collate_pairs(pairs, 0)
    packed = collate_pairs(pairs, 0, pack_to=448)
    assert packed["input_ids"].shape[0] < unpacked["input_ids"].shape[0] == 12  # fewer rows
    assert packed["input_ids"].numel() < 0.75 * unpacked["input_ids"].numel()  # less padding
    loss, stats, grads = step(objective, model, unpacked)
    packed_loss, packed_stats, packed_grads = step(objective, model, packed)
    assert max(abs(a - b) for a, b in zip(loss, packed_loss)) < 1e-5, (loss, packed_loss)
    # the answers' log-probabilities are sums of up to 400 float32 terms, added in another order when packed: their
    # rounding, a few float32 epsilons of the sums' size, is what the metrics made of them may differ by
    scale = 8 * torch.finfo(torch.float32).eps * (abs(stats["logps/chosen"]) + abs(stats["logps/rejected"]))
    assert all(abs(stats[k] - packed_stats[k]) <= scale for k in stats), (scale, stats, packed_stats)
    assert grads.keys() == packed_grads.keys() and len(grads) == 28
    for name, g in grads.items():
        assert torch.allclose(g, packed_grads[name], atol=1e-5, rtol=1e-4), name


def test_a_packed_row_holds_each_answer_whole_with_its_own_positions():
    pairs = mixed_pairs(3, seed=1)
    batch = collate_pairs(pairs, 0, pack_to=448)
    sequences = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    for i, s in enumerate(sequences):  # every answer in one row, contiguous, positions from 0, its own segment
        rows, cols = (batch["sequence"] == i).nonzero().unbind(1)
        assert rows.unique().numel() == 1 and (cols == torch.arange(cols[0], cols[0] + len(s["input_ids"]))).all()
        assert batch["input_ids"][rows[0], cols].tolist() == s["input_ids"]
        assert batch["position_ids"][rows[0], cols].tolist() == list(range(len(s["input_ids"])))
        assert batch["segment_ids"][rows[0], cols].unique().numel() == 1
        assert batch["answer"][rows[0], cols].tolist() == [j >= s["prompt_len"] for j in range(len(s["input_ids"]))]
    assert int(batch["sequences"]) == 6 and (batch["sequence"] >= 0).sum() == sum(
        len(s["input_ids"]) for s in sequences
    )


@pytest.mark.parametrize("objective", ["dpo", "orpo", "kto"])
def test_train_packs_preference_pairs(objective, long_ckpt, tmp_path):
    """data.packing with a preference objective trains through `lora-llama train`, its first step's loss the unpacked
    run's."""
    from lora_llama.cli import main

    words = "the quick brown fox jumps over the lazy dog and then some".split()
    rows = [
        {"prompt": " ".join(words[: 3 + i % 4]), "chosen": " ".join(words * (2 + i % 5)), "rejected": words[i % 10]}
        for i in range(16)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = []
    for packing in ("false", "true"):
        out = tmp_path / f"run-{packing}"
        args = ["train", str(tmp_path / "r.yaml"), f"model.source={long_ckpt}", f"data.source={data}"]
        args += ["data.format=preference", f"train.objective={objective}", f"data.packing={packing}"]
        args += ["data.max_seq_len=512", "train.max_steps=1", "train.batch_size=4", "data.val_size=0"]
        args += ["train.precision=fp32", f"output.dir={out}", "lora.dropout=0"]
        (tmp_path / "r.yaml").write_text("")
        assert main(args) == 0
        first.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"])
    assert abs(first[0] - first[1]) < 1e-5, first


def test_packed_kto_trains_as_the_unpacked(long_ckpt):
    """KTO: its completions packed into rows and their mismatched ones into rows of their own; the KL estimate, the
    loss, the metrics and the gradients are the padded batch's."""
    from lora_llama.objectives.kto import KTO, KTOSettings
    from lora_llama.runtime.distributed import Ranks

    model = adapted(long_ckpt)
    pairs = mixed_pairs(4, seed=2)
    answers = [p[side] for p in pairs for side in ("chosen", "rejected")]  # 8 completions of 5-400 tokens
    examples = []
    for i, a in enumerate(answers):
        other = answers[(i + 3) % len(answers)]  # another prompt's answer, after this prompt: KL's mismatched row
        prompt = a["input_ids"][: a["prompt_len"]]
        mismatched = other["input_ids"][other["prompt_len"] :]
        examples.append(
            {
                **a,
                "label": i % 2 == 0,
                "mismatched": {"input_ids": prompt + mismatched, "labels": [-100] * len(prompt) + mismatched},
            }
        )
    objective, results = KTO(KTOSettings(beta=0.1)), []
    for pack_to in (None, 448):
        objective.pack_to = pack_to
        [batch] = objective.prepare(model, [objective.collate(examples, 0)], 0, Ranks())
        results.append((batch["input_ids"].numel(), float(batch["kl"]), *step(objective, model, batch)))
    (padded, kl, loss, stats, grads), (packed, packed_kl, packed_loss, packed_stats, packed_grads) = results
    # sums of up to 400 float32 log-probabilities, added in another order when packed (see the test above)
    scale = 8 * torch.finfo(torch.float32).eps * (abs(stats["logps/chosen"]) + abs(stats["logps/rejected"]))
    assert packed < 0.75 * padded and abs(kl - packed_kl) <= scale and abs(loss[0] - packed_loss[0]) < 1e-5
    assert all(abs(stats[k] - packed_stats[k]) <= max(scale, 1e-5) for k in stats), (stats, packed_stats)
    assert grads.keys() == packed_grads.keys() and len(grads) == 28
    for name, g in grads.items():
        assert torch.allclose(g, packed_grads[name], atol=1e-5, rtol=1e-4), name
