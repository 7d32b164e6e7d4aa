"""Tool-calling through the trainer: a template that cannot render tools is refused, SFT on tool-use
conversations, a killed tool-calling run resumes exactly, two processes equal one."""

import json

import pytest
import torch
from test_tools import CALL, TOOLS_FILE, tool_tokenizer

from helpers import build_checkpoint, make_tokenizer
from lora_llama.data.templates import chat_template_text, renders_tools
from lora_llama.errors import UserError
from lora_llama.objectives.grpo import rollout
from lora_llama.objectives.grpo.objective import GRPO, GRPOSettings
from lora_llama.objectives.grpo.tools import load_tools, tool_schemas
from lora_llama.recipe.schema import DataSection


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
    [example] = tokenize_records(
        datasets.Dataset.from_list([record]), tok, DataSection(format="auto", max_seq_len=1024)
    )
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
import lora_llama.objectives.grpo.rollout as _rollout
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


@pytest.mark.parametrize("credit", ["trajectory", "turn"])
def test_a_killed_tool_calling_run_resumes_exactly_and_logs_the_tools(tiny_ckpt, tmp_path, monkeypatch, credit):
    from safetensors.torch import load_file
    from test_grpo_train import metrics

    import lora_llama.training.trainer as trainer
    from lora_llama.training.from_recipe import train_from_recipe

    with_stand_ins(monkeypatch)
    ckpt = build_checkpoint(tmp_path / "ckpt", max_position_embeddings=2048)
    (tmp_path / "a").mkdir()
    credited = f"train.grpo.credit={credit}"
    train_from_recipe(tool_run(ckpt, tmp_path / "a", tmp_path / "full", credited), log=lambda *_: None)
    rows = [m for m in metrics(tmp_path / "full") if "loss" in m]
    assert all(m["tools/call_frequency"] > 0 for m in rows) and all(m["tools/turns"] > 1 for m in rows), rows
    assert all(m["tools/failure_frequency"] == 0 for m in rows) and "rewards/Adder/mean" in rows[0]
    assert (tmp_path / "full" / "adapter" / "chat_template.jinja").read_text() == chat_template_text("chatml-tools")

    (tmp_path / "b").mkdir()
    cut = tool_run(ckpt, tmp_path / "b", tmp_path / "cut", credited)
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


def test_the_template_an_adapter_was_trained_with_goes_with_it_into_merge_and_generate(tiny_ckpt, tmp_path):
    """An adapter folder holding chat_template.jinja (data.chat_template's): `merge` writes it as the merged
    model's template, and the generate / eval commands' tokenizer renders with it."""
    import argparse

    from transformers import AutoTokenizer

    from helpers import make_adapter
    from lora_llama.commands import _load
    from lora_llama.outputs.merge import merge_checkpoint

    adapter = make_adapter(tiny_ckpt, tmp_path / "adapter")
    (tmp_path / "adapter" / "chat_template.jinja").write_text(chat_template_text("chatml-tools"))
    merge_checkpoint(tiny_ckpt, adapter, tmp_path / "merged")
    merged = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert merged.chat_template == chat_template_text("chatml-tools") and renders_tools(merged)
    args = argparse.Namespace(model=str(tiny_ckpt), adapter=str(adapter), dtype="float32", device="cpu")
    assert renders_tools(_load(args)[1]) and not renders_tools(AutoTokenizer.from_pretrained(tiny_ckpt))


def test_the_calculator_data_lists_the_calculator_tool_as_transformers_describes_it():
    """calculator-chats carry recipes/tools/calculator.py's schema, so SFT and GRPO show the model the same
    listing; each conversation's call computes its answer, `correct` scores the last number and `right_call` the
    turn that calls."""
    from pathlib import Path

    from lora_llama.data.loading import CALCULATOR_TOOL, REGISTERED_RECORDS
    from lora_llama.objectives.grpo.rewards import load_reward

    root = Path(__file__).resolve().parents[1]
    calculate = load_tools([f"{root}/recipes/tools/calculator.py:calculate"])[0]
    correct = load_reward(f"{root}/recipes/tools/calculator.py:correct")[1]
    assert tool_schemas(GRPOSettings(tools=[f"{root}/recipes/tools/calculator.py:calculate"])) == [CALCULATOR_TOOL]
    chats, questions = REGISTERED_RECORDS["calculator-chats"](), REGISTERED_RECORDS["calculator-questions"]()
    for chat in chats[:50]:
        call, result = chat["messages"][1]["tool_calls"][0]["function"], chat["messages"][2]["content"]
        assert calculate(**call["arguments"]) == result and chat["tools"] == [CALCULATOR_TOOL]
    assert {q["prompt"].split()[0] for q in questions} == {"What", "How", "Add", "Subtract", "Multiply"}
    assert correct(None, [[{"role": "assistant", "content": "482 * 37 = 17834."}]] * 2, ["17834", "17835"]) == [
        1.0,
        0.0,
    ]
    assert calculate("482 * 37") == "17834" and calculate("7 / 2") == "3.5"
    # right_call scores the turn that calls: 1 when the expression's value is the answer; the reply goes unscored
    right_call = load_reward(f"{root}/recipes/tools/calculator.py:right_call")[1]
    conversation, result = chats[0]["messages"][1:], chats[0]["messages"][2]["content"]
    assert right_call(None, [conversation] * 2, [result, "-1"]) == [[1.0, None], [0.0, None]]
