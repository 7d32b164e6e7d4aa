"""Tool-calling GRPO against trl's GRPOTrainer (`tools`, and `environment_factory`): the same model turns give
the same prompts (tools listed by the template), completion ids, tool mask, rewards, advantages and loss; and
the bad inputs of tools, each one line or an answer the model reads."""

import textwrap
import time

import pytest
import torch
from test_grpo import _policy

from helpers import build_checkpoint, hf_model, make_tokenizer
from lora_llama.data.prompts import prompt_examples
from lora_llama.data.templates import chat_template_text, tool_calls
from lora_llama.errors import UserError
from lora_llama.objectives.grpo import rollout
from lora_llama.objectives.grpo.objective import GRPO, GRPOSettings
from lora_llama.objectives.grpo.rewards import score_rollouts
from lora_llama.objectives.grpo.tools import Toolbox, answer_calls, load_environment, load_tools, tool_schemas
from lora_llama.recipe.schema import DataSection
from lora_llama.runtime.distributed import Ranks

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
# each row's turns: a call answered then a reply; no call; a call to no such tool; a call with a wrong argument
SCRIPT = [[CALL, "I do not know", CALL.replace("add", "mul"), CALL.replace('"b": 3', '"c": 3')], ["It is 5"] * 4]
TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


class Adder:
    """An episode: add answers, and the reward is how often it was asked."""

    def reset(self, **row):
        self.asked = 0
        return " (use the tool)"

    def add(self, a: int, b: int) -> int:
        """Add two whole numbers.

        Args:
            a: the first number
            b: the second number
        """
        self.asked += 1
        return a + b

    def get_reward(self):
        return float(self.asked)
'''


def tool_tokenizer():
    """The test tokenizer with the chatml-tools template, and the response template trl parses calls with; no BOS
    added to a rendering (trl renders prompts without the tokenizer's special tokens, and the template writes
    none)."""
    from trl.chat_template_utils import qwen3_template

    tok = make_tokenizer()
    tok.backend_tokenizer.post_processor = None
    tok.chat_template = chat_template_text("chatml-tools")
    tok.response_template = qwen3_template
    return tok


def turns_of(tok, turn: int, rows: list[int]) -> list[list[int]]:
    return [tok(SCRIPT[turn][i], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for i in rows]


def scripted_turns(tok):
    """sample_turns with the model's turns read from SCRIPT (what trl's generation is given too)."""

    def sample(model, prompts, max_new_tokens, eos_ids, pad_id, respond, **_):
        pieces, going, turn = [[] for _ in prompts], list(range(len(prompts))), 0
        while going:
            turns = turns_of(tok, turn, going)
            for i, t in zip(going, turns):
                pieces[i].append((t, True))
            added = respond(going, turns)
            going = [i for i, more in zip(going, added) if more and not pieces[i].append((more, False))]
            turn += 1
        return pieces

    return sample


def count_tools(prompts, completions, **_):
    """A reward that reads the completion's messages: its tool answers, and its calls."""
    return [float(sum(m["role"] == "tool" for m in c) + 0.5 * len(c[0].get("tool_calls", []))) for c in completions]


def trl_rollouts(ckpt, adapter, tok, folder, tools_module, environment: bool):
    from datasets import Dataset
    from peft import PeftModel
    from trl import GRPOConfig, GRPOTrainer

    calls = []

    def generate(self, prompt_ids, images, multimodal, num_generations, **_):
        turn = len(calls)
        calls.append(len(prompt_ids))
        rows = [0, 1, 2, 3] if turn == 0 else [i for i in range(4) if "<tool_call>" in SCRIPT[0][i]]
        return turns_of(tok, turn, rows), None

    cfg = GRPOConfig(
        output_dir=str(folder),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=256,
        max_tool_calling_iterations=3,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    prompts = [[{"role": "user", "content": f"what is 2 + {i}?"}] for i in (3, 4)]
    trainer = GRPOTrainer(
        model=PeftModel.from_pretrained(hf_model(ckpt), adapter, is_trainable=True),
        reward_funcs=[count_tools],
        args=cfg,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=tok,
        tools=None if environment else [tools_module.add],
        environment_factory=tools_module.Adder if environment else None,
    )
    trainer._generate_single_turn = generate.__get__(trainer)
    out = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(2)])
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, out)
    return out, float(loss.detach()), prompts


@pytest.mark.parametrize("environment", [False, True])
def test_tool_rollouts_and_their_loss_equal_trls(tmp_path, monkeypatch, environment):
    """trl's GRPOTrainer with `tools` (or `environment_factory`) and ours, the model's turns scripted alike: the
    prompts with their tool listing, each completion's ids (turns and tool answers) and tool mask, the rewards'
    view of the conversation (through their advantages) and the loss, within 1e-5 in fp32."""
    import importlib.util

    ckpt = build_checkpoint(tmp_path / "ckpt", max_position_embeddings=2048)  # room for the listing of tools
    (tmp_path / "calc.py").write_text(TOOLS_FILE)
    spec = importlib.util.spec_from_file_location("calc_tools", tmp_path / "calc.py")
    calc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calc)
    tok = tool_tokenizer()
    model = _policy(ckpt, tmp_path / "adapter")
    want, want_loss, prompts = trl_rollouts(ckpt, tmp_path / "adapter", tok, tmp_path / "trl", calc, environment)

    which = (
        {"environment": f"{tmp_path / 'calc.py'}:Adder"} if environment else {"tools": [f"{tmp_path / 'calc.py'}:add"]}
    )
    settings = GRPOSettings(
        group_size=2, max_new_tokens=256, max_tool_calling_iterations=3, rewards=["count_tools"], **which
    )
    monkeypatch.setattr(rollout, "sample_turns", scripted_turns(tok))
    monkeypatch.setattr(rollout, "load_reward", lambda spec: ("count_tools", count_tools))
    import datasets

    records = datasets.Dataset.from_list([{"prompt": p} for p in prompts])
    examples, _ = prompt_examples(records, tok, DataSection(), 2048, tools=tool_schemas(settings))
    grpo = GRPO(settings, tok, [tok.eos_token_id], seed=0)
    batch = grpo.rollouts.batch(model, examples, generation=0)
    score_rollouts([batch], Ranks(), grpo.reward_weights, grpo.reward_names, settings)

    for i in range(4):
        prompt = want["prompt_ids"][i][want["prompt_mask"][i].bool()].tolist()
        kept = want["completion_mask"][i].bool()
        completion = want["completion_ids"][i][kept].tolist()
        row = batch["input_ids"][i].tolist()[: len(prompt) + len(completion)]
        assert row == prompt + completion, i
        targets = batch["labels"][i][len(prompt) : len(prompt) + len(completion)]
        assert ((targets != -100).long() == want["tool_mask"][i][kept]).all(), i
    assert torch.allclose(batch["advantages"], want["advantages"], atol=1e-5), (batch["advantages"], want["advantages"])
    model.train()
    terms, _ = grpo.terms(model, batch)
    loss = float(terms[0] / grpo.counts(batch)[0])
    assert abs(loss - want_loss) < 1e-5, (loss, want_loss)
    calls, failures, turns = batch["tools"].sum(0).tolist()
    assert (calls, failures, turns) == (3.0, 2.0, 7.0)  # rows 0, 2, 3 call; mul and the wrong argument fail


def test_calls_are_read_in_the_templates_syntax():
    tagged = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><tool_call>{"name": 3}</tool_call>'
    assert tool_calls(tagged) == (
        [{"name": "add", "arguments": {"a": 1}}],
        ["the call '{\"name\": 3}' names no function"],
    )
    assert tool_calls('{"name": "add", "parameters": {"a": 1}}') == ([{"name": "add", "arguments": {"a": 1}}], [])
    calls, errors = tool_calls("<tool_call>{not json}</tool_call>")
    assert calls == [] and errors[0].startswith("the call '{not json}' is not JSON")
    assert tool_calls("no call here") == ([], [])


def test_a_tool_that_fails_or_hangs_is_answered_and_the_others_are_not_held_up(tmp_path):
    (tmp_path / "t.py").write_text(
        textwrap.dedent('''
        import time

        def slow(seconds: float) -> str:
            """Sleep.

            Args:
                seconds: how long
            """
            time.sleep(seconds)
            return "woke"

        def broken(x: int) -> int:
            """Raise.

            Args:
                x: anything
            """
            raise RuntimeError("no luck")
        ''')
    )
    box = Toolbox(load_tools([f"{tmp_path / 't.py'}:slow", f"{tmp_path / 't.py'}:broken"]))
    requests = [
        (box, [{"name": "slow", "arguments": {"seconds": 0.3}}], []),
        (box, [{"name": "slow", "arguments": {"seconds": 30}}], []),
        (box, [{"name": "broken", "arguments": {"x": 1}}, {"name": "nope", "arguments": {}}], ["bad call"]),
        (box, [{"name": "slow", "arguments": {"minutes": 1}}], []),
    ]
    start = time.monotonic()
    answered = answer_calls(requests, timeout_s=1.0)
    assert time.monotonic() - start < 2.0  # the hung call costs the timeout once, not a wait per row
    contents = [[m["content"] for m in messages] for messages, _ in answered]
    assert contents[0] == ["woke"] and answered[0][1] == 0
    assert contents[1] == [str({"error": "timed out after 1 s"})] and answered[1][1] == 1
    assert (
        contents[2]
        == [
            str({"error": "no luck"}),
            str({"error": "Tool nope not found."}),
            str({"error": "bad call"}),
        ]
        and answered[2][1] == 3
    )
    assert "unexpected keyword argument 'minutes'" in contents[3][0] and answered[3][1] == 1


@pytest.mark.parametrize(
    "source, spec, message",
    [
        ("raise ImportError('nope')\n", "tools:add", "importing .* raised ImportError: nope"),
        ("x = 1\n", "tools:add", "has no function 'add'"),
        ("def add(a, b):\n    return a + b\n", "tools:add", "type hint on each argument"),
        ("class Env:\n    pass\n", "env:Env", "no reset method"),
    ],
)
def test_bad_tools_are_one_line(tmp_path, source, spec, message):
    what, name = spec.split(":")
    (tmp_path / "t.py").write_text(source)
    load = load_tools if what == "tools" else lambda specs: load_environment(specs[0])
    with pytest.raises(UserError, match=message):
        load([f"{tmp_path / 't.py'}:{name}"])
