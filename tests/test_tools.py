"""Tool-calling GRPO against trl's GRPOTrainer (`tools`, and `environment_factory`): the same model turns give
the same prompts (tools listed by the template), completion ids, tool mask, rewards, advantages and loss; and
the bad inputs of tools, each one line or an answer the model reads."""

import json
import textwrap
import time

import pytest
import torch
from test_grpo import _policy

from helpers import build_checkpoint, hf_model, make_tokenizer
from lora_llama.data.prompts import prompt_examples
from lora_llama.data.templates import chat_template_text, renders_tools, tool_calls
from lora_llama.errors import UserError
from lora_llama.objectives import rollout
from lora_llama.objectives.grpo import GRPO, GRPOSettings
from lora_llama.objectives.rewards import score_rollouts
from lora_llama.objectives.tools import Toolbox, answer_calls, load_environment, load_tools, tool_schemas
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
    examples, _ = prompt_examples(records, tok, 2048, tools=tool_schemas(settings))
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


def test_a_template_that_cannot_render_tools_is_refused_naming_data_chat_template(tiny_ckpt, tmp_path):
    from lora_llama.recipe.schema import load_recipe

    tok = make_tokenizer()  # plain ChatML: no tools, no calls
    assert not renders_tools(tok) and renders_tools(tool_tokenizer())
    (tmp_path / "t.py").write_text(TOOLS_FILE)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "what is 2 + 3?"}) + "\n")
    recipe = load_recipe(
        None,
        [
            "train.objective=grpo",
            f"data.source={tmp_path / 'p.jsonl'}",
            "data.format=prompt",
            f"train.grpo.tools=[{tmp_path / 't.py'}:add]",
            "train.grpo.rewards=[format]",
        ],
    )
    with pytest.raises(UserError, match="set data.chat_template"):
        GRPO.examples(recipe, tok, lambda *_: None)


def test_sft_on_tool_use_conversations_targets_the_calls_and_answers_not_the_results(tmp_path):
    """data.chat_template chatml-tools on OpenAI-style records (an assistant's tool_calls, with arguments as a JSON
    string, a tool turn, the record's `tools`): the system turn lists the tools, and the targets are exactly the
    assistant's call and its answer, each with its end-of-turn token; the tool's result is context."""
    from lora_llama.data.sft import tokenize_records

    (tmp_path / "t.py").write_text(TOOLS_FILE)
    schema = tool_schemas(GRPOSettings(tools=[f"{tmp_path / 't.py'}:add"]))
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    record = {
        "messages": [
            {"role": "user", "content": "what is 2 + 3?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": "5"},
            {"role": "assistant", "content": "It is 5"},
        ],
        "tools": json.dumps(schema),
    }
    import datasets

    tok = tool_tokenizer()
    [example] = tokenize_records(datasets.Dataset.from_list([record]), tok, "auto", 1024)
    text = tok.decode(example["input_ids"])
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    runs, run = [], []
    for t, label in zip(example["input_ids"], example["labels"]):
        if label != -100:
            run.append(t)
        elif run:
            runs.append(tok.decode(run))
            run = []
    runs += [tok.decode(run)] if run else []
    # a turn's target runs through its rendering's end, the newline after its end-of-turn token too, as trl's
    # training templates mark it (qwen2_5_training.jinja's generation blocks)
    assert runs == [CALL + "<|im_end|>\n", "It is 5<|im_end|>\n"]


def tool_run(ckpt, tmp_path, out, *overrides):
    from test_grpo_train import grpo_recipe

    (tmp_path / "calc.py").write_text(TOOLS_FILE)
    return grpo_recipe(
        ckpt,
        tmp_path,
        "data.chat_template=chatml-tools",
        "data.max_seq_len=1024",
        "train.grpo.max_new_tokens=160",
        f"train.grpo.environment={tmp_path / 'calc.py'}:Adder",
        "train.grpo.max_tool_calling_iterations=2",
        "train.max_steps=4",
        "train.save_every=2",
        "train.eval_every=4",
        f"output.dir={out}",
        *overrides,
    )


# Stand-ins for what a random model never does, the rollouts still a function of the sampled tokens alone: a
# sampled turn ends where its row's uniform is over 0.8 (EOS, id 2, is the test tokenizer's end of turn), and a
# turn of even length in characters calls add.
STAND_INS = """
import lora_llama.model.generate as _generate
import lora_llama.objectives.rollout as _rollout
_pick, _read = _generate.pick, _rollout.tool_calls
def ending(logits, temperature, top_k, top_p, u):
    token = _pick(logits, temperature, top_k, top_p, u)
    return token if u is None else token.masked_fill(u > 0.8, 2)
def read(text):
    if text and len(text) % 2 == 0:
        return [{"name": "add", "arguments": {"a": len(text), "b": 1}}], []
    return _read(text)
"""


def with_stand_ins(monkeypatch):
    from lora_llama.model import generate

    made = {}
    exec(STAND_INS, made)
    monkeypatch.setattr(generate, "pick", made["ending"])
    monkeypatch.setattr(rollout, "tool_calls", made["read"])


def test_a_killed_tool_calling_run_resumes_exactly_and_logs_the_tools(tiny_ckpt, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from test_grpo_train import metrics

    import lora_llama.training.trainer as trainer
    from lora_llama.training.from_recipe import train_from_recipe

    with_stand_ins(monkeypatch)
    ckpt = build_checkpoint(tmp_path / "ckpt", max_position_embeddings=2048)
    (tmp_path / "a").mkdir()
    train_from_recipe(tool_run(ckpt, tmp_path / "a", tmp_path / "full"), log=lambda *_: None)
    rows = [m for m in metrics(tmp_path / "full") if "loss" in m]
    assert all(m["tools/call_frequency"] > 0 for m in rows) and all(m["tools/turns"] > 1 for m in rows), rows
    assert all(m["tools/failure_frequency"] == 0 for m in rows) and "rewards/Adder/mean" in rows[0]
    assert (tmp_path / "full" / "adapter" / "chat_template.jinja").read_text() == chat_template_text("chatml-tools")

    (tmp_path / "b").mkdir()
    cut = tool_run(ckpt, tmp_path / "b", tmp_path / "cut")
    original = trainer.Trainer.train_step

    def stop_at_2(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(trainer.Trainer, "train_step", stop_at_2)
    with pytest.raises(KeyboardInterrupt):
        train_from_recipe(cut, log=lambda *_: None)
    monkeypatch.setattr(trainer.Trainer, "train_step", original)
    train_from_recipe(cut, log=lambda *_: None)
    a, b = (load_file(tmp_path / r / "adapter" / "adapter_model.safetensors") for r in ("full", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tool_calling_run_on_two_processes_equals_one(tmp_path, monkeypatch):
    """ddp: each process runs its own rows' episodes; rewards, advantages and the tools/ metrics are the global
    batch's, as one process's."""
    from lora_llama.cli import main
    from two_processes import assert_same_runs, patched_script, rows, torchrun

    ckpt = build_checkpoint(tmp_path / "ckpt", max_position_embeddings=2048)
    tool_run(ckpt, tmp_path, tmp_path / "unused")  # writes the prompt, reward and tools files
    common = [
        f"model.source={ckpt}",
        f"data.source={tmp_path / 'p.jsonl'}",
        "data.format=prompt",
        "data.val_size=0.25",
        "data.max_seq_len=1024",
        "data.chat_template=chatml-tools",
        "train.objective=grpo",
        f"train.grpo.rewards=[{tmp_path / 'rewards.py'}:low_ids]",
        f"train.grpo.environment={tmp_path / 'calc.py'}:Adder",
        "train.grpo.group_size=4",
        "train.grpo.max_new_tokens=160",
        "train.grpo.scale_rewards=batch",
        "train.precision=fp32",
        "model.device=cpu",
        "train.warmup_steps=0",
        "train.lr=1e-3",
        "train.max_steps=3",
        "train.eval_every=3",
        "train.save_every=1",
        "lora.targets=[q,v]",
        "train.collective_timeout_s=60",
        "train.distributed=ddp",
    ]
    (tmp_path / "empty.yaml").write_text("")
    recipe = str(tmp_path / "empty.yaml")
    with_stand_ins(monkeypatch)
    assert main(["train", recipe, *common, "train.batch_size=2", f"output.dir={tmp_path / 'one'}"]) == 0
    script = patched_script(tmp_path, STAND_INS + "_generate.pick = ending\n_rollout.tool_calls = read\n")
    argv = ["train", recipe, *common, "train.batch_size=1", f"output.dir={tmp_path / 'two'}"]
    code, out, err = torchrun(argv, script=script)
    assert code == 0, err[-3000:]
    keys = ("loss", "reward", "tools/call_frequency", "tools/failure_frequency", "tools/turns", "eval_reward")
    assert_same_runs(tmp_path / "one", tmp_path / "two", keys)
    assert any(r.get("tools/call_frequency", 0) > 0 for r in rows(tmp_path / "one"))
