"""Bad input a user types or brings, each one line on stderr and exit code 2 before any work: devices that do not
exist, data records with null fields, truncated weight files, counts below their least value."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import RECIPE, chat_file, one_error_line
from lora_llama.cli import main


def run(capsys, args) -> str:
    """stderr of `lora-llama ARGS`, which must fail with one line and exit code 2 (argparse's own exits too)."""
    try:
        code = main(args)
    except SystemExit as e:  # argparse exits itself
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and one_error_line(err), (args, code, err)
    return err


def train(tiny_ckpt, data, out, *extra):
    return [
        "train",
        RECIPE,
        f"model.source={tiny_ckpt}",
        f"data.source={data}",
        f"output.dir={out}",
        "train.max_steps=1",
        "data.val_size=0",
        *extra,
    ]


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x", "gpu0"])
def test_an_unknown_device_is_refused(tiny_ckpt, tmp_path, capsys, device):
    data = chat_file(tmp_path / "d.jsonl", [("hi", "hello")] * 4)
    assert "device" in run(capsys, train(tiny_ckpt, data, tmp_path / "run", f"model.device={device}"))
    assert device in run(capsys, ["generate", "--model", str(tiny_ckpt), "--prompt", "hi", "--device", device])
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_this_machine_lacks_is_refused(tiny_ckpt, tmp_path, capsys):
    data = chat_file(tmp_path / "d.jsonl", [("hi", "hello")] * 4)
    for device in ("cuda", "cuda:1"):
        assert "0 CUDA GPUs" in run(capsys, train(tiny_ckpt, data, tmp_path / "run", f"model.device={device}"))
        assert device in run(capsys, ["eval", "--model", str(tiny_ckpt), "--data", str(data), "--device", device])
    assert not (tmp_path / "run").exists()


ANSWER = {"role": "assistant", "content": "x"}


@pytest.mark.parametrize(
    "fmt,record,says",
    [
        ("chat", {"messages": None}, "a null 'messages'"),
        ("chat", {"messages": []}, "empty messages"),
        (
            "chat",
            {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
            "a user turn",
        ),
        ("chat", {"messages": [{"role": "bot", "content": "x"}]}, "unknown role 'bot'"),
        ("chat", {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}, "int content"),
        ("text", {"text": None}, "a null 'text'"),
        ("alpaca", {"instruction": "say hi", "output": None}, "a null 'output'"),  # or absent: JSONL reads null
    ],
)
def test_a_bad_row_is_skipped_and_counted_and_strict_refuses_it(tiny_ckpt, tmp_path, capsys, fmt, record, says):
    """The run trains on the good rows and names each bad one (its row, counting from 1, and why); with
    data.strict one line names the source and the row, exit 2, nothing written."""
    good = {
        "chat": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        "text": {"text": "hello there"},
        "alpaca": {"instruction": "say hi", "output": "hi"},
    }[fmt]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [good, good, record, good]))
    assert main(train(tiny_ckpt, data, tmp_path / "run", f"data.format={fmt}")) == 0
    out = capsys.readouterr()
    assert f"skipped 1 of 4 rows of {data}: 1 with {says}" in out.out + out.err and "(row 3)" in out.out + out.err
    err = run(capsys, train(tiny_ckpt, data, tmp_path / "strict", f"data.format={fmt}", "data.strict=true"))
    assert f"data {data}: row 3: {says}" in err and not (tmp_path / "strict").exists()


def test_rows_that_are_all_bad_leave_no_example_and_say_why(tiny_ckpt, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": ["hi", "hello"]}) + "\n")  # strings, not {role, content}
    err = run(capsys, train(tiny_ckpt, data, tmp_path / "run", "data.format=chat"))
    assert "gives no training example" in err


def test_mixed_chat_styles_read_each_message_whole(tiny_ckpt):
    """A file mixing {role, content} and {from, value} messages reads back with the other style's keys null."""
    from lora_llama.data.chat import normalise_messages

    mixed = [
        {"role": "user", "content": "hi", "from": None, "value": None},
        {"role": None, "content": None, "from": "gpt", "value": "hello"},
    ]
    assert normalise_messages(mixed) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_a_truncated_base_is_named_by_merge_and_export(tiny_ckpt, tmp_path, capsys):
    from lora_llama import LoraSettings, apply_lora, load_model, save_adapter

    model = load_model(tiny_ckpt)
    apply_lora(model, LoraSettings(r=4, alpha=8))
    adapter = save_adapter(model, tmp_path / "adapter")
    base = tmp_path / "base"
    shutil.copytree(tiny_ckpt, base)
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for args in (
        ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "merged")],
        ["export", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m.gguf")],
    ):
        err = run(capsys, args)
        assert "model.safetensors" in err and "truncated" in err, err
    assert not (tmp_path / "merged").exists() and not (tmp_path / "m.gguf").exists()


def test_fsdp_row_reading_names_a_file_cut_inside_its_header(tiny_ckpt, tmp_path):
    from lora_llama.errors import UserError
    from lora_llama.files.checkpoint_rows import CheckpointRows

    base = tmp_path / "base"
    shutil.copytree(tiny_ckpt, base)
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    with pytest.raises(UserError, match="model.safetensors: truncated|cannot read .*model.safetensors"):
        CheckpointRows(base)


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--max-new-tokens", "-4"],
        ["generate", "--max-new-tokens", "0"],
        ["generate", "--max-new-tokens", "x"],
        ["generate", "--top-k", "0"],
        ["generate", "--top-p", "1.5"],
        ["generate", "--top-p", "0"],
        ["generate", "--temperature", "-1"],
        ["generate", "--temperature", "nan"],
        ["eval", "--batch-size", "0"],
    ],
)
def test_counts_below_their_least_value_are_refused_before_any_work(tiny_ckpt, capsys, args):
    extra = ["--prompt", "hi"] if args[0] == "generate" else ["--data", "missing.jsonl"]
    err = run(capsys, [args[0], "--model", str(tiny_ckpt), *args[1:], *extra])
    assert args[1] in err


def test_the_python_api_refuses_a_count_below_one(tiny_ckpt):
    from lora_llama import load_model
    from lora_llama.model.generate import generate

    model = load_model(tiny_ckpt)
    for n in (0, -4):
        with pytest.raises(ValueError, match="at least 1"):
            generate(model, [5, 6, 7], max_new_tokens=n)


@pytest.mark.parametrize("flag,value", [("--nproc-per-node", "0"), ("--nnodes", "0"), ("--node-rank", "-1")])
def test_process_counts_below_their_least_value_are_refused(capsys, flag, value):
    assert flag in run(capsys, ["train", RECIPE, flag, value])


def test_broken_or_hostile_adapters_are_refused_before_allocating(tiny_ckpt, tmp_path, capsys):
    from safetensors.torch import save_file

    from lora_llama import LoraSettings, apply_lora, load_model, save_adapter

    model = load_model(tiny_ckpt)
    apply_lora(model, LoraSettings(r=4, alpha=8))
    good = save_adapter(model, tmp_path / "good")
    cfg = json.loads((good / "adapter_config.json").read_text())
    tensors = load_file(good / "adapter_model.safetensors")
    nan = {**tensors, next(iter(tensors)): torch.full_like(next(iter(tensors.values())), float("nan"))}
    cases = {
        "huge rank": ({**cfg, "r": 10**9}, tensors, "says r=1000000000, its tensors have rank 4"),
        "nan": (cfg, nan, "NaN, inf"),
        "unknown module to save": ({**cfg, "modules_to_save": ["norm"]}, tensors, "modules_to_save 'norm'"),
        "module to save missing": ({**cfg, "modules_to_save": ["lm_head"]}, tensors, "'base_model.model.lm_head."),
        "truncated": (cfg, None, "adapter_model.safetensors"),
        "bad json": (None, tensors, "adapter_config.json"),
    }
    for name, (c, t, message) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(c) if c is not None else "{oops")
        if t is None:
            (folder / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes()[:50])
        else:
            save_file(t, folder / "adapter_model.safetensors")
        code = main(
            ["generate", "--model", str(tiny_ckpt), "--adapter", str(folder), "--prompt", "hi", "--max-new-tokens", "1"]
        )
        err = capsys.readouterr().err
        assert code == 2 and message in err and one_error_line(err), (name, err)


def test_broken_index_and_gguf_name_the_file(tiny_ckpt, smollm2, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LORA_LLAMA_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    shutil.copytree(tiny_ckpt, folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(smollm2.read_bytes()[: 3 << 20])
    for model, name in ((folder, "model.safetensors.index.json"), (gguf, "cut.gguf")):
        assert main(["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
        err = capsys.readouterr().err
        assert name in err and one_error_line(err), err


# keys the recipe fuzz writes: real ones, sections, a path too deep, an unknown one, the empty one
RECIPE_KEYS = [
    "lora.r",
    "lora.alpha",
    "lora.targets",
    "lora.layers",
    "train.lr",
    "train.max_steps",
    "train.epochs",
    "train.betas",
    "data.max_seq_len",
    "data.format",
    "data.fields",
    "model.dtype",
    "model.quantize",
    "output.dir",
    "lora",
    "train",
    "x.y",
    "lora.r.z",
    "",
]


def test_any_recipe_input_gives_exit_0_or_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import lora_llama.training.from_recipe

    monkeypatch.setattr(
        lora_llama.training.from_recipe, "train_from_recipe", lambda *a, **k: {"steps": 0}
    )  # validation is the subject
    keys = st.sampled_from(RECIPE_KEYS)
    values = st.one_of(
        st.integers(-5, 10**6).map(str),
        st.floats(allow_nan=True).map(str),
        st.sampled_from(["null", "[q, v]", "[1, 2]", "{a: 1}", "true", "bf16", "'", "[", "{", ":", "- x"]),
        st.text(max_size=12),
    )
    overrides = st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", keys, values), st.text(max_size=12)), max_size=4)
    recipe_text = st.one_of(
        st.just("lora: {r: 4}\n"),
        st.text(max_size=40),
        st.builds(lambda k, v: f"{k.split('.')[0]}:\n  {k.split('.')[-1]}: {v}\n", keys, values),
    )

    @settings(
        max_examples=int(os.environ.get("RECIPE_EXAMPLES", 150)),
        deadline=None,
        derandomize="RECIPE_EXAMPLES" not in os.environ,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(recipe_text, overrides)
    def check(text, items):
        path = tmp_path / "r.yaml"
        path.write_text(text)
        code = main(["train", str(path), *[i for i in items if not i.startswith("-")]])
        captured = capsys.readouterr()
        assert code in (0, 2), (text, items, captured.err)
        if code == 2:
            assert one_error_line(captured.err), captured.err

    check()
