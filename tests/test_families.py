"""Mistral, Qwen2, Qwen3, Llama 3.2 and Gemma 3 (text) in the one native model, each against transformers' own
class and peft. No Gemma checkpoint can be downloaded here: its tests build a tiny random one with transformers'
own config class, as for every family."""

import json

import pytest
import torch

from helpers import ALL, ROOT, build_checkpoint, hf_model, make_tokenizer, token_ids
from lora_llama import LoraSettings, apply_lora, load_adapter, load_model, save_adapter
from lora_llama.cli import main
from lora_llama.lora.adapted import lora_modules
from lora_llama.model.generate import generate
from lora_llama.objectives.token_losses import target_loss

LLAMA32_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
GEMMA3 = dict(
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
    },
)
FAMILIES = {  # name: (model_type, config overrides); all GQA 4:2 (TINY)
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral_window": ("mistral", dict(sliding_window=8)),  # shorter than every sequence below
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),  # head_dim given explicitly, != hidden / heads
    "llama3.2": ("llama", dict(rope_parameters=LLAMA32_ROPE, tie_word_embeddings=True)),
    # a sliding layer (window 8, shorter than every sequence below, RoPE base 10k) and a global one (base 1M,
    # linear scaling as Gemma 3 4B's), scores scaled by query_pre_attn_scalar, not head_dim; embeddings tied
    "gemma3": ("gemma3_text", GEMMA3),
}
CLASSES = {
    "gemma3_text": "Gemma3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    model_type, overrides = FAMILIES[request.param]
    folder = build_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", family=model_type, **overrides)
    return request.param, model_type, folder


def ids(batch=2, seq=40, seed=1):
    return token_ids(batch, seq, seed)


def test_logits_match_transformers_own_class(family):
    name, model_type, folder = family
    ref_model = hf_model(folder)
    assert type(ref_model).__name__ == CLASSES[model_type]
    x = ids()
    with torch.no_grad():
        assert (load_model(folder)(x) - ref_model(x).logits).abs().max() < 1e-4


def test_greedy_generation_with_the_cache_equals_transformers(family):
    """24 new tokens after a 9-token prompt: well past a sliding window of 8."""
    _, _, folder = family
    prompt = ids(1, 9, seed=7)[0].tolist()
    ours = generate(load_model(folder), prompt, max_new_tokens=24)
    ref = (
        hf_model(folder)
        .generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(prompt) :
        ]
        .tolist()
    )
    assert ours == ref == generate(load_model(folder), prompt, max_new_tokens=24, use_cache=False)


def test_training_loss_and_gradients_equal_transformers(family):
    """The training path (fused LoRA nodes, lean saving, the chunked loss) against transformers + peft."""
    from peft import LoraConfig, get_peft_model

    _, _, folder = family
    x = ids(2, 30, seed=3)
    model = load_model(folder).train()
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    peft = get_peft_model(
        hf_model(folder).train(), LoraConfig(r=4, lora_alpha=8, target_modules=[f"{t}_proj" for t in ALL])
    )
    with torch.no_grad():  # the same non-zero B in both, so every path carries a gradient
        for (n, p), (_, q) in zip(
            sorted(model.named_parameters()),
            sorted(
                (k.removeprefix("base_model.model.").replace(".default", ""), v) for k, v in peft.named_parameters()
            ),
        ):
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
                q.copy_(p)
            elif "lora_A" in n:
                q.copy_(p)
    loss, n = target_loss(model, x, x)
    (loss / n).backward()
    ref = peft(input_ids=x, labels=x)
    ref.loss.backward()
    assert abs(float(loss / n) - float(ref.loss)) < 1e-5
    ours = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    theirs = {
        k.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for k, p in peft.named_parameters()
        if p.grad is not None
    }
    assert ours.keys() == theirs.keys() and len(ours) == 2 * 7 * 2
    for k in ours:
        assert (ours[k] - theirs[k]).abs().max() < 1e-5, k


def test_packed_rows_respect_the_sliding_window_and_segments(family):
    name, _, folder = family
    model = load_model(folder)
    a, b = ids(1, 13, seed=4), ids(1, 17, seed=5)
    pos = torch.cat([torch.arange(13), torch.arange(17)])[None]
    seg = torch.tensor([[0] * 13 + [1] * 17])
    with torch.no_grad():
        out = model(torch.cat([a, b], 1), position_ids=pos, segment_ids=seg)
        assert (out[:, :13] - model(a)).abs().max() < 1e-5 and (out[:, 13:] - model(b)).abs().max() < 1e-5


def test_adapter_merge_and_int8_per_family(family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name, model_type, folder = family
    model = load_model(folder)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    save_adapter(model, tmp_path / "a")
    x = ids()
    peft = PeftModel.from_pretrained(hf_model(folder), tmp_path / "a").eval()
    with torch.no_grad():
        assert (model(x) - peft(x).logits).abs().max() < 1e-4
        assert (
            main(["merge", "--base", str(folder), "--adapter", str(tmp_path / "a"), "--out", str(tmp_path / "m")]) == 0
        )
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
        assert type(merged).__name__ == CLASSES[model_type]
        assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == [CLASSES[model_type]]
        assert (merged(x).logits - peft.merge_and_unload()(x).logits).abs().max() < 1e-5
        int8 = load_model(folder, quantize="int8")
        load_adapter(int8, tmp_path / "a")
        ref = model(x)
        assert (int8(x) - ref).abs().max() / ref.abs().max() < 0.05


# ---------------------------------------------------------------------------- chat templates


QWEN25_TEMPLATE = (  # Qwen2.5-Instruct's template without its tool branches
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's template
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def template_tokenizer(template, specials, eos):
    """The tests' BPE tokenizer with a family's special tokens and chat template."""
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.eos_token = eos
    tok.chat_template = template
    return tok


def test_chatml_labels_hand_checked():
    from lora_llama.data.chat import end_of_turn_id
    from lora_llama.data.sft import IGNORE_INDEX as M
    from lora_llama.data.sft import Tokenize

    tok = template_tokenizer(QWEN25_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|endoftext|>")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ex = Tokenize(tok, "chat", 512).chat(msgs)

    def p(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    system = (
        [start] + p("system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.") + [end] + p("\n")
    )
    user = [start] + p("user\nhi") + [end] + p("\n")
    prompt = [tok.bos_token_id] + system + user + [start] + p("assistant\n")
    answer = p("hello") + [end] + p("\n")
    assert ex["input_ids"] == prompt + answer  # no extra EOS: <|im_end|> ends the turn
    assert ex["labels"] == [M] * len(prompt) + answer
    assert end_of_turn_id(tok) == end != tok.eos_token_id


def test_llama3_labels_hand_checked():
    from lora_llama.data.chat import end_of_turn_id
    from lora_llama.data.sft import IGNORE_INDEX as M
    from lora_llama.data.sft import Tokenize

    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"]
    tok = template_tokenizer(LLAMA3_TEMPLATE, specials, "<|end_of_text|>")  # a base Llama 3 tokenizer's EOS
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "fox"},
        {"role": "assistant", "content": "dog"},
    ]
    ex = Tokenize(tok, "chat", 512).chat(msgs)

    def p(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    sh, eh, eot = (tok.convert_tokens_to_ids(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))

    def turn(role, text):
        return [sh] + p(role) + [eh] + p("\n\n" + text) + [eot]

    def head(role):
        return [sh] + p(role) + [eh] + p("\n\n")

    hello, dog = p("hello") + [eot], p("dog") + [eot]
    assert p("\n\nhello") == p("\n\n") + p("hello")  # the split below is exact for this tokenizer
    ids = (
        [tok.bos_token_id]
        + turn("system", "be brief")
        + turn("user", "hi")
        + head("assistant")
        + hello
        + turn("user", "fox")
        + head("assistant")
        + dog
    )
    assert ex["input_ids"] == ids and ex["input_ids"].count(tok.bos_token_id) == 1
    first = 1 + len(turn("system", "be brief")) + len(turn("user", "hi")) + len(head("assistant"))
    second = len(turn("user", "fox")) + len(head("assistant"))
    assert ex["labels"] == [M] * first + hello + [M] * second + dog  # <|eot_id|> is the stop, no <|end_of_text|> added
    assert end_of_turn_id(tok) == eot


def test_generation_stops_at_every_end_of_turn_id(tiny_ckpt, tmp_path):
    """generation_config may list several EOS ids (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>)."""
    import shutil

    from lora_llama import load_tokenizer
    from lora_llama.data.chat import eos_token_ids

    folder = tmp_path / "m"
    shutil.copytree(tiny_ckpt, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 57, 91]}))
    model, tok = load_model(folder), load_tokenizer(folder)
    assert {2, 57, 91} <= set(eos_token_ids(model, tok))
    free = generate(model, [1, 5, 9], max_new_tokens=12)
    stop = free[4]
    assert generate(model, [1, 5, 9], max_new_tokens=12, eos_ids=[stop]) == free[: free.index(stop) + 1]


def test_untrained_stop_token_warning(tmp_path, capsys, smollm2):
    """Fires on a base whose end-of-turn rows are zero (as base Qwen's <|im_end|>), not on SmolLM2."""
    from safetensors.torch import load_file, save_file

    folder = build_checkpoint(tmp_path / "base")
    tensors = load_file(folder / "model.safetensors")
    eot = 2  # <|im_end|>, which ends a turn in the tests' ChatML template
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[key][eot] = 0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
    )
    recipe = str(ROOT / "recipes" / "smollm2-chat-cpu.yaml")

    def run(source, out, *extra):
        return main(
            [
                "train",
                recipe,
                f"data.source={data}",
                "data.val_size=0",
                "train.max_steps=1",
                f"model.source={source}",
                f"output.dir={out}",
                *extra,
            ]
        )

    assert run(folder, tmp_path / "r1") == 0
    out = capsys.readouterr().out
    assert "looks untrained" in out and "lora.trainable_token_indices: {embed_tokens: [2], lm_head: [2]}" in out
    rows = "lora.trainable_token_indices={embed_tokens: [2], lm_head: [2]}"
    assert run(folder, tmp_path / "r4", rows) == 0  # the setting the warning names: the rows train
    assert "looks untrained" not in capsys.readouterr().out
    trained = load_file(tmp_path / "r4" / "adapter" / "adapter_model.safetensors")
    for module in ("model.embed_tokens", "lm_head"):
        assert trained[f"base_model.model.{module}.token_adapter.trainable_tokens_delta"].abs().min() > 0
    assert run(folder, tmp_path / "r2", "lora.targets=[q,v,lm_head]") == 0  # lm_head adapted: it can learn the row
    assert "looks untrained" not in capsys.readouterr().out
    assert run("smollm2-135m-instruct", tmp_path / "r3") == 0
    assert "looks untrained" not in capsys.readouterr().out
