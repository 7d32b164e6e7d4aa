"""Every common shape of conversation data read by `data.format: auto`, each giving the labels the same data
gives written as messages; a shape that fits none is one line naming the columns."""

import json

import pytest
from datasets import Dataset

from helpers import make_tokenizer
from lora_llama.data.records import detect_format
from lora_llama.data.sft import IGNORE_INDEX, tokenize_records
from lora_llama.errors import UserError
from lora_llama.recipe.schema import DataSection

# ChatML with tool calls and tool results, as Qwen's and Hermes' templates render them
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>{% else %}{{ m['content'] }}"
    "{% endif %}{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is the capital of france?"},
    {"role": "assistant", "content": "paris is."},
]
SHAREGPT = [
    {"from": "system", "value": "be brief"},
    {"from": "human", "value": "what is the capital of france?"},
    {"from": "gpt", "value": "paris is."},
]
CALL = {"name": "weather", "arguments": {"city": "paris"}}
WITH_TOOLS = [
    {"role": "user", "content": "weather in paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "it is sunny."},
]
SHAREGPT_TOOLS = [
    {"from": "human", "value": "weather in paris?"},
    {"from": "function_call", "value": json.dumps(CALL)},
    {"from": "observation", "value": "sunny"},
    {"from": "gpt", "value": "it is sunny."},
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def examples(tok, rows, fmt="auto"):
    records = Dataset.from_list(rows)
    return [
        (e["input_ids"], e["labels"]) for e in tokenize_records(records, tok, DataSection(format=fmt, max_seq_len=256))
    ]


@pytest.mark.parametrize(
    "rows",
    [
        [{"conversations": SHAREGPT}],  # ShareGPT
        [{"prompt": MESSAGES[:2], "completion": MESSAGES[2:]}],  # trl's conversational prompt-completion
        [{"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]}],  # text parts
    ],
)
def test_each_conversation_shape_gives_the_labels_of_its_messages_form(tok, rows):
    want = examples(tok, [{"messages": MESSAGES}])
    assert examples(tok, rows) == want and any(t != IGNORE_INDEX for t in want[0][1])


def test_tool_calls_and_results_read_from_messages_and_sharegpt_alike(tok):
    tok = make_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    (ids, labels), *_ = examples(tok, [{"messages": WITH_TOOLS}])
    assert examples(tok, [{"conversations": SHAREGPT_TOOLS}]) == [(ids, labels)]
    targets = tok.decode([t for t in labels if t != IGNORE_INDEX])
    assert '<tool_call>{"name": "weather"' in targets and "sunny</tool_response>" not in targets  # the call is learned


def test_standard_prompt_completion_is_plain_text_with_the_completion_as_target(tok):
    (ids, labels), *_ = examples(tok, [{"prompt": "the capital of france is", "completion": " paris."}])
    prompt = tok("the capital of france is")["input_ids"]
    completion = tok(" paris.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == prompt + completion and labels == [IGNORE_INDEX] * len(prompt) + completion


@pytest.mark.parametrize(
    "columns, fmt",
    [
        (["messages"], "chat"),
        (["conversations", "id"], "chat"),
        (["prompt", "completion"], "prompt-completion"),
        (["instruction", "input", "output"], "alpaca"),
        (["text", "meta"], "text"),
        (["prompt", "chosen", "rejected"], "preference"),
        (["chosen", "rejected"], "preference"),
        (["prompt", "completion", "label"], "unpaired"),
    ],
)
def test_auto_reads_the_shape_from_the_columns(columns, fmt):
    assert detect_format(columns) == fmt


def test_a_shape_that_fits_none_names_the_columns_seen():
    with pytest.raises(UserError, match=r"columns \(question, reply\)"):
        detect_format(["question", "reply"])


def test_implicit_prompt_pairs_split_as_trls_extract_prompt():
    from trl.data_utils import extract_prompt

    from lora_llama.data.preference import implicit_prompt

    conversational = {"chosen": MESSAGES, "rejected": [*MESSAGES[:2], {"role": "assistant", "content": "rome."}]}
    standard = {"chosen": "the sky is blue.", "rejected": "the sky is green."}
    for pair in (conversational, standard):
        assert implicit_prompt(pair) == {**pair, **extract_prompt(pair)}
