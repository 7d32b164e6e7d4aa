"""Credit per turn (train.grpo.credit: turn): rewards by turn from the reward functions, each turn's return and its
advantage against the same turn of its group, by hand; each target token of a scripted tool-calling rollout takes
its own turn's advantage in the loss, packed or not."""

import math
from types import SimpleNamespace

import pytest
import torch
from test_grpo import _policy
from test_tools import SCRIPT, TOOLS_FILE, scripted_turns, tool_tokenizer, turns_of

from helpers import build_checkpoint
from lora_llama.data.prompts import prompt_examples
from lora_llama.errors import UserError
from lora_llama.objectives.grpo import rollout
from lora_llama.objectives.grpo.credit import set_turn_advantages, turn_returns
from lora_llama.objectives.grpo.objective import GRPO, GRPOSettings
from lora_llama.objectives.grpo.rewards import by_completion, score_rollouts, score_turns, weighted_rewards
from lora_llama.objectives.grpo.tools import tool_schemas
from lora_llama.recipe.schema import DataSection
from lora_llama.runtime.distributed import Ranks

nan = math.nan
TURNS = [2, 1, 3, 2]


def whole(prompts, completions, **_):
    return [1.0, 0.0, 1.0, None]  # a number: the completion's, at its last turn


def each_turn(prompts, completions, **_):
    return [[2.0, None], None, [4.0, 0.0, 2.0], []]  # lists: the first turns', in order


def table_by_hand() -> torch.Tensor:
    table = score_turns({"whole": whole, "each_turn": each_turn}, ["p"] * 4, ["c"] * 4, {}, TURNS)
    want = torch.tensor(
        [
            [[nan, 1.0, nan], [2.0, nan, nan]],
            [[0.0, nan, nan], [nan, nan, nan]],
            [[nan, nan, 1.0], [4.0, 0.0, 2.0]],
            [[nan, nan, nan], [nan, nan, nan]],
        ]
    )
    assert torch.equal(table.isnan(), want.isnan()) and torch.equal(table.nan_to_num(), want.nan_to_num())
    return table


def test_rewards_by_turn_and_the_returns_from_each_turn_on_by_hand():
    table, weights = table_by_hand(), torch.tensor([1.0, 0.5])
    # whole completions: each function's turns summed (trajectory credit sees only these)
    assert torch.equal(by_completion(table).nan_to_num(-1), torch.tensor([[1.0, 2.0], [0.0, -1], [1.0, 6.0], [-1, -1]]))
    returns = turn_returns(table, weights, torch.tensor(TURNS))
    # row 0: turn rewards 0.5*2 = 1 then 1; row 1: 0; row 2: 0.5*4 = 2, 0, 1 + 0.5*2 = 2; row 3 scored nothing
    want = torch.tensor([[2.0, 1.0, nan], [0.0, nan, nan], [4.0, 2.0, 2.0], [nan, nan, nan]])
    assert torch.equal(returns.isnan(), want.isnan()) and torch.equal(returns.nan_to_num(), want.nan_to_num())
    # the first turn's return is the whole completion's weighted reward
    total = weighted_rewards(by_completion(table), weights)
    assert torch.equal(returns[:, 0].nan_to_num(-1), total.nan_to_num(-1))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_each_turn_is_normalised_against_the_same_turn_of_its_group(scale):
    batch = {"turn_rewards": table_by_hand(), "turns": torch.tensor(TURNS)}
    set_turn_advantages(
        [batch], Ranks(), torch.tensor([1.0, 0.5]), SimpleNamespace(group_size=4, scale_rewards=scale, credit="turn")
    )
    # turn 0: returns 2, 0, 4 (mean 2, std 2); turn 1: 1 and 2 (mean 1.5, std sqrt(0.5)); turn 2: one return, no
    # spread to compare it with; every place without a return gets 0
    centred = torch.tensor([[0.0, -0.5, 0], [-2, 0, 0], [2, 0.5, 0], [0, 0, 0]])
    if scale == "group":
        want = centred / torch.tensor([2.0, math.sqrt(0.5), 1.0]).add(1e-4)
    elif scale == "batch":  # the std of every turn's return: 2, 1, 0, 4, 2, 2
        want = centred / (torch.tensor([2.0, 1, 0, 4, 2, 2]).std() + 1e-4)
    else:
        want = centred
    assert torch.allclose(batch["advantages"], want), batch["advantages"]


def test_a_list_longer_than_the_turns_is_one_line_naming_the_row():
    def too_many(prompts, completions, **_):
        return [[1.0], [1.0, 1.0]]

    with pytest.raises(
        UserError, match=r"reward too_many returned 2 values for row 1 \(prompt 'q'\), which has 1 turns"
    ):
        score_turns({"too_many": too_many}, ["p", "q"], ["a", "b"], {}, [2, 1])


def test_credit_per_turn_needs_turns():
    with pytest.raises(ValueError, match="credit turn needs tools or an environment"):
        GRPOSettings(credit="turn", rewards=["format"])


def per_turn_reward(prompts, completions, **_):
    """Each assistant turn: 1 with a call, 0.25 without; the whole completion: its count of tool answers."""
    return [[1.0 if m.get("tool_calls") else 0.25 for m in c if m["role"] == "assistant"] for c in completions]


def answered(prompts, completions, **_):
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]


@pytest.mark.parametrize("packing", [False, True])
def test_each_target_token_takes_its_turns_advantage(tmp_path, monkeypatch, packing):
    """The scripted turns of test_tools (rows 0, 2, 3 call, read the answer and reply; row 1 replies at once):
    at ratio 1 the dapo loss is minus the sum of the target tokens' advantages, so it equals minus each turn's
    advantage times that turn's token count in the script, whether the completions sit one to a row or packed."""
    ckpt = build_checkpoint(tmp_path / "ckpt", max_position_embeddings=2048)
    (tmp_path / "calc.py").write_text(TOOLS_FILE)
    tok = tool_tokenizer()
    model = _policy(ckpt, tmp_path / "adapter")
    settings = GRPOSettings(
        group_size=2, max_new_tokens=256, tools=[f"{tmp_path / 'calc.py'}:add"], rewards=["a", "b"], credit="turn"
    )
    monkeypatch.setattr(rollout, "sample_turns", scripted_turns(tok))
    functions = {"a": per_turn_reward, "b": answered}
    monkeypatch.setattr(rollout, "load_reward", lambda spec: (spec, functions[spec]))
    import datasets

    prompts = [[{"role": "user", "content": f"what is 2 + {i}?"}] for i in (3, 4)]
    records = datasets.Dataset.from_list([{"prompt": p} for p in prompts])
    examples, _ = prompt_examples(records, tok, DataSection(), 2048, tools=tool_schemas(settings))
    grpo = GRPO(settings, tok, [tok.eos_token_id], seed=0, packing=packing, max_seq_len=2048)
    batch = grpo.rollouts.batch(model, examples, generation=0)
    score_rollouts([batch], Ranks(), grpo.reward_weights, grpo.reward_names, settings)
    set_turn_advantages([batch], Ranks(), grpo.reward_weights, settings)
    advantages = batch["advantages"]
    assert batch["turns"].tolist() == [2, 1, 2, 2] and (batch["input_ids"].shape[0] < 4) == packing
    # groups (0, 1) and (2, 3); row 1's first turn has no call and no tool answer: the lowest return of its group
    assert advantages[0, 0] > 0 > advantages[1, 0] and advantages[1, 1] == 0
    model.train()
    [loss], _ = grpo.terms(model, batch)
    by_turn = [
        [len(turns_of(tok, t, [i])[0]) if t == 0 or "<tool_call>" in SCRIPT[0][i] else 0 for t in (0, 1)]
        for i in range(4)
    ]
    want = -sum(float(advantages[i, t]) * by_turn[i][t] for i in range(4) for t in (0, 1))
    loss = float(loss.detach())
    assert abs(loss - want) < 1e-5 * max(1.0, abs(want)), (loss, want)
