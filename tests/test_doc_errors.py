"""Every line docs/troubleshooting.md quotes is what the code prints for the mistake it names: each quoted line has
a trigger here that makes that mistake and reads what the user sees (`...` stands for any text, a word `N` for a
number), and a quoted line with no trigger fails, so the page cannot quote a line the code no longer prints."""

from __future__ import annotations

import errno
import json
import re
import shutil

import pytest
import torch
from test_moe import MOE

from helpers import ROOT, build_checkpoint, chat_file, make_adapter
from lora_llama.cli import main
from lora_llama.errors import UserError

PAGE = ROOT / "docs" / "troubleshooting.md"
QA = [("hi", "hello"), ("to be", "or not to be"), ("the quick", "brown fox"), ("how are you", "i am fine")] * 2


def quoted_lines() -> list[str]:
    """The lines the table's first column quotes (several per row where ` / ` joins them)."""
    table = PAGE.read_text().split("| the line says |")[1].split("\n\n")[0]
    lines = []
    for row in table.splitlines()[2:]:
        lines += re.findall(r"`([^`]+)`", row.split(" | ")[0])
    return lines


def pattern(quote: str) -> re.Pattern:
    parts = re.split(r"(\.\.\.|(?<=[\s(])N\b)", quote)  # N as a word of its own (not cuda:N)
    return re.compile("".join(".*?" if p == "..." else r"\d+" if p == "N" else re.escape(p) for p in parts))


class Mistakes:
    """What a user sees for each mistake: the CLI's stderr (backticks dropped, as the page cannot nest them)."""

    def __init__(self, tiny, tmp_path, capsys, monkeypatch):
        self.tiny, self.tmp, self.capsys, self.monkeypatch = tiny, tmp_path, capsys, monkeypatch
        self.empty = tmp_path / "empty.yaml"
        self.empty.write_text("")
        self.data = chat_file(tmp_path / "d.jsonl", QA)

    def cli(self, *args, code: int = 2) -> str:
        self.capsys.readouterr()
        try:
            returned = main([str(a) for a in args])
        except SystemExit as e:  # argparse's mistakes
            returned = e.code
        assert returned == code, args
        captured = self.capsys.readouterr()
        return (captured.err + captured.out).replace("`", "")

    def train(self, *overrides, code: int = 2, out: str = "run") -> str:
        base = [f"model.source={self.tiny}", f"data.source={self.data}", f"output.dir={self.tmp / out}"]
        base += ["train.max_steps=1", "data.val_size=0", "train.precision=fp32"]
        return self.cli("train", self.empty, *base, *overrides, code=code)

    @staticmethod
    def error(work) -> str:
        with pytest.raises(UserError) as e:
            work()
        return str(e.value)

    def grpo(self, reward: str | None = None) -> str:
        prompts = self.tmp / "p.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in QA))
        return self.train(
            "train.objective=grpo",
            "data.format=prompt",
            f"data.source={prompts}",
            *([f"train.grpo.rewards=[{reward}]"] if reward else []),
            "train.grpo.group_size=2",
            "train.grpo.max_new_tokens=4",
            "train.batch_size=2",
        )

    def rewards(self, fn) -> str:
        from lora_llama.objectives.grpo.rewards import score

        prompts, completions = [f"what is {i}?" for i in range(8)], [f"{i}" for i in range(8)]
        return self.error(lambda: score({"correct": fn}, prompts, completions, {}))


def raises_key_error(prompts, completions, **columns):
    return [float(c == columns["answer"]) for c in completions]


TRIGGERS = {
    "unknown recipe key 'train.learning_rate' (did you mean 'train.lr'?)": lambda m: m.train("train.learning_rate=1"),
    "recipe key 'lora.r': Input should be greater than 0 (got 0)": lambda m: m.train("lora.r=0"),
    "recipe: train.objective dpo reads data.format preference (or auto), not chat "
    "(which train.objective sft reads)": lambda m: m.train("train.objective=dpo"),
    "recipe: train.objective grpo reads data.format prompt (or auto), not chat ...": lambda m: m.train(
        "train.objective=grpo"
    ),
    "reward correct raised KeyError: 'answer' on row N (prompt '...')": lambda m: m.rewards(raises_key_error),
    "reward correct returned 7 values for 8 completions ...": lambda m: m.rewards(lambda completions, **k: [1.0] * 7),
    "reward correct returned 'yes' (str) for row N ...": lambda m: m.rewards(lambda completions, **k: ["yes"] * 8),
    "reward 'rewards.py:check': no such file rewards.py": lambda m: m.grpo("rewards.py:check"),
    "train.grpo.rewards: reasoning_gym scores reasoning-gym data (its 'entry' column), which this data.source has "
    "not: ...": lambda m: m.grpo(),
    "recipe: lora.init_lora_weights pissa moves W0's principal part into A and B, which lora.dropout would drop ...": (
        lambda m: m.train("lora.init_lora_weights=pissa", "lora.dropout=0.1")
    ),
    "a DoRA adapter has no llama.cpp LoRA form ...": lambda m: m.cli(
        "export", "--adapter", m.dora(), "--lora-gguf", m.tmp / "a.gguf"
    ),
    "recipe file not found: ...": lambda m: m.cli("train", m.tmp / "missing.yaml"),
    "data source not found: ...": lambda m: m.train("data.source=missing.jsonl"),
    "warning: skipped N of N rows of ...: N with a null 'messages' (row...); N with a user turn without content ...": (
        lambda m: m.train(f"data.source={m.bad_rows()}", code=0)
    ),
    "data ...: row N: a null 'messages' (data.strict: true stops at a bad row)": lambda m: m.train(
        f"data.source={m.bad_rows()}", "data.strict=true"
    ),
    "recipe key 'model.device': String should match pattern ... (got 'tpu')": lambda m: m.train("model.device=tpu"),
    "unknown device 'tpu' (use auto, cpu, cuda or cuda:N)": lambda m: m.cli(
        "generate", "--model", m.tiny, "--prompt", "hi", "--device", "tpu"
    ),
    "device cuda:8: this machine has N CUDA GPUs visible to torch ...": lambda m: m.no_ninth_gpu(),
    "cannot read .../model.safetensors: truncated or not a safetensors file ...": lambda m: m.truncated(),
    "argument --max-new-tokens: -4 is less than 1": lambda m: m.cli(
        "generate", "--model", m.tiny, "--prompt", "hi", "--max-new-tokens", "-4"
    ),
    "... holds a finished run; pass --force to start over or choose another output.dir": lambda m: m.twice(),
    "... is in use by a running lora-llama train (pid N); wait for it to end or choose another output.dir": (
        lambda m: m.locked()
    ),
    "... already exists (pass --force to overwrite)": lambda m: m.cli(
        "merge", "--base", m.tiny, "--adapter", make_adapter(m.tiny, m.tmp / "a"), "--out", m.tmp
    ),
    "non-finite loss (nan) at step N; ...": lambda m: m.nan_loss(),
    "model.quantize source keeps a GGUF file's own blocks; ... is not a GGUF base": lambda m: m.train(
        "model.quantize=source"
    ),
    "train.distributed=fsdp with lora.targets lm_head is not supported; use ddp, or drop lm_head": (
        lambda m: m.fsdp_lm_head()
    ),
    "fsdp shards nf4 layers by row: in_features N is not a multiple of 64": lambda m: m.fsdp_nf4(),
    "--nnodes above 1 needs --rdzv-endpoint HOST:PORT ...": lambda m: m.cli("train", m.empty, "--nnodes", "2"),
    "model_type 'gemma' is not supported (supported: ...)": lambda m: m.gemma(),
    "layer N of this ... model is a mixture of experts, with no mlp.gate_proj: its experts take lora.targets "
    "experts; ...": lambda m: m.train(f"model.source={m.mixture()}", "lora.targets=[q,gate]"),
    "lora.targets experts: this llama model has no mixture of experts (its MLP's linears are gate, up, down)": (
        lambda m: m.train("lora.targets=[q,experts]")
    ),
    "train.distributed=fsdp on a mixture of experts is not supported; use ddp": lambda m: m.fsdp_mixture(),
    "... in llama.cpp's llama architecture, which is not read from GGUF ...": lambda m: m.gguf_mixture(),
    "llama.cpp's qwen3moe renormalises the chosen experts' weights; ...": lambda m: m.unrenormalised_export(),
    "adapter for ... has lora_A (N, N) and lora_B (N, N), which do not fit the base weight (N, N)": (
        lambda m: m.other_base()
    ),
    "cannot write ...: No space left on device ...": lambda m: m.full_disk(),
    "no Hugging Face token: pass --token, set HF_TOKEN, or run hf auth login": lambda m: m.no_token(),
    "... was trained with global batch 4 x 2 processes ...: resume with train.batch_size=8": (
        lambda m: m.other_world()
    ),
}


class MoreMistakes(Mistakes):
    def mixture(self, name: str = "qwen3_moe", **extra):
        folder, (model_type, overrides) = self.tmp / f"{name}-{len(extra)}", MOE[name]
        return folder if folder.is_dir() else build_checkpoint(folder, family=model_type, **{**overrides, **extra})

    def fsdp_mixture(self):
        from lora_llama.loading.models import model_source
        from lora_llama.recipe.schema import load_recipe
        from lora_llama.runtime.distributed import Ranks
        from lora_llama.training.from_recipe import _choose_strategy

        source, two = model_source(str(self.mixture())), Ranks(rank=0, world=2)
        return self.error(lambda: _choose_strategy(load_recipe(None, ["train.distributed=fsdp"]), two, "cpu", source))

    def gguf_mixture(self):
        self.cli("export", "--base", self.mixture("mixtral"), "--out", self.tmp / "mixtral.gguf", code=0)
        return self.cli("generate", "--model", self.tmp / "mixtral.gguf", "--prompt", "hi")

    def unrenormalised_export(self):
        return self.cli("export", "--base", self.mixture(norm_topk_prob=False), "--out", self.tmp / "plain.gguf")

    def dora(self):
        from lora_llama import LoraSettings, apply_lora, load_model, save_adapter

        model = load_model(self.tiny)
        apply_lora(model, LoraSettings(r=4, alpha=8, targets=["q", "v"], use_dora=True))
        return save_adapter(model, self.tmp / "dora")

    def bad_rows(self):
        rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA]
        rows += [{"messages": None}, {"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}]
        (self.tmp / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return self.tmp / "bad.jsonl"

    def no_ninth_gpu(self):
        self.monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        self.monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        return self.train("model.device=cuda:8")

    def truncated(self):
        copy = shutil.copytree(self.tiny, self.tmp / "cut")
        weights = copy / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        return self.cli("generate", "--model", copy, "--prompt", "hi")

    def twice(self):
        self.train(code=0)
        return self.train()

    def locked(self):
        from lora_llama.training.run_folder import run_lock

        with run_lock(self.tmp / "run"):
            return self.train()

    def nan_loss(self):
        import lora_llama.objectives.sft as sft

        real = sft.target_loss

        def poisoned(*a, **k):
            loss, n = real(*a, **k)
            return loss * float("nan"), n

        self.monkeypatch.setattr(sft, "target_loss", poisoned)
        return self.train()

    def fsdp_lm_head(self):
        from lora_llama.loading.models import model_source
        from lora_llama.recipe.schema import load_recipe
        from lora_llama.runtime.distributed import Ranks
        from lora_llama.training.from_recipe import _choose_strategy

        recipe = load_recipe(None, ["train.distributed=fsdp", "lora.targets=[q,lm_head]"])
        ranks = Ranks(rank=0, world=2)
        return self.error(lambda: _choose_strategy(recipe, ranks, "cpu", model_source(str(self.tiny))))

    def fsdp_nf4(self):
        from lora_llama.loading.sharded import _meta_layer
        from lora_llama.quant.handlers import NF4

        return self.error(lambda: _meta_layer(torch.nn.Linear(96, 64), NF4()))

    def gemma(self):
        folder = shutil.copytree(self.tiny, self.tmp / "gemma")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
        return self.cli("generate", "--model", folder, "--prompt", "hi")

    def other_base(self):
        wider = build_checkpoint(self.tmp / "wider", hidden_size=96, intermediate_size=128)
        adapter = make_adapter(self.tiny, self.tmp / "a")
        return self.cli("merge", "--base", wider, "--adapter", adapter, "--out", self.tmp / "merged")

    def full_disk(self):
        import safetensors.torch

        def enospc(tensors, path, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        self.monkeypatch.setattr(safetensors.torch, "save_file", enospc)
        return self.train()

    def no_token(self):
        self.monkeypatch.delenv("HF_TOKEN", raising=False)
        self.monkeypatch.setenv("HF_HOME", str(self.tmp / "hf"))
        return self.cli("push", make_adapter(self.tiny, self.tmp / "a"), "--repo-id", "ann/tuned")

    def other_world(self):
        from types import SimpleNamespace

        from lora_llama.training.checkpoints import check_global_batch

        saved = {"batch_size": 4, "world_size": 2, "grad_accum": 1}
        train = SimpleNamespace(batch_size=4, grad_accum=1)
        return self.error(lambda: check_global_batch(saved, train, 1, self.tmp / "checkpoints" / "step-4"))


def test_every_quoted_line_has_a_trigger():
    assert set(quoted_lines()) == set(TRIGGERS), set(quoted_lines()) ^ set(TRIGGERS)


@pytest.mark.parametrize("quote", list(TRIGGERS))
def test_the_code_prints_the_line_the_page_quotes(quote, tiny_ckpt, tmp_path, capsys, monkeypatch):
    said = TRIGGERS[quote](MoreMistakes(tiny_ckpt, tmp_path, capsys, monkeypatch)).replace("`", "")
    assert pattern(quote).search(said), said


def unknown_tool(m) -> str:
    from lora_llama.objectives.grpo.tools import Toolbox, answer_calls

    [(messages, failures)] = answer_calls([(Toolbox({}), [{"name": "mul", "arguments": {}}], [])], timeout_s=1.0)
    return messages[0]["content"]


def bad_roles(m) -> str:
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA]
    rows += [{"messages": [{"role": "bot", "content": "x"}]}, {"messages": []}]
    (m.tmp / "roles.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return m.train(f"data.source={m.tmp / 'roles.jsonl'}", code=0)


def studio_refusal(m) -> str:
    """The line the studio's terminal shows for a POST from another page."""
    import http.client
    import threading
    import time
    from urllib.parse import urlparse

    from lora_llama.studio.server import serve

    ready = []
    kwargs = {"ready": ready.append}
    threading.Thread(target=serve, args=(m.tmp / "runs", "127.0.0.1", 0), kwargs=kwargs, daemon=True).start()
    while not ready:
        time.sleep(0.05)
    m.capsys.readouterr()
    connection = http.client.HTTPConnection("127.0.0.1", urlparse(ready[0]).port, timeout=10)
    connection.request("POST", "/api/start", b"{}", {"Origin": "http://127.0.0.1:8000", "Content-Type": "text/plain"})
    connection.getresponse().read()
    return m.capsys.readouterr().err


# lines other pages quote, each with its page: the page's line and the code's both match the quote's pattern
ELSEWHERE = {
    (
        "data.md",
        "warning: skipped N of N rows of ...: N with unknown role 'bot' (row...); N with empty messages (row N)",
    ): (bad_roles),
    ("grpo.md", "reward correct raised KeyError: 'answer' on row N (prompt '...')"): lambda m: m.rewards(
        raises_key_error
    ),
    ("agents.md", "{'error': 'Tool mul not found.'}"): unknown_tool,
    ("studio.md", "lora-llama studio: refused POST /api/start: Origin '...' is not the studio's own page"): (
        studio_refusal
    ),
    ("studio.md", "is not a port (0 to 65535)"): lambda m: m.cli("studio", "--port", "99999"),
}


@pytest.mark.parametrize(("page", "quote"), list(ELSEWHERE))
def test_what_other_pages_quote_is_what_the_code_prints(page, quote, tiny_ckpt, tmp_path, capsys, monkeypatch):
    shown = " ".join((ROOT / "docs" / page).read_text().split())  # a quote may wrap in the page
    assert pattern(quote).search(shown), f"{page} no longer quotes {quote!r}"
    said = ELSEWHERE[page, quote](MoreMistakes(tiny_ckpt, tmp_path, capsys, monkeypatch)).replace("`", "")
    assert pattern(quote).search(said), said
