"""The studio's Chat tab and a finished run's Ship card in a real browser (Debian's chromium, driven by
Playwright): a model alone and with an adapter (a run's, a checkpoint's, a folder of one's own) answer as `lora-llama
generate` does for the same prompt and seed; Merge writes run/merged, which chat then offers; and a command's
output is pushed to the page as it is written."""

import json
import shutil
import subprocess
import sys
import threading
import urllib.error

import pytest
from studio_page import ROOT, needs_chromium, shot, tiny_run

from lora_llama.studio.client import StudioClient


def generated(model, prompt: str, seed: int, max_new_tokens: int, adapter=None) -> str:
    """What `lora-llama generate --chat` prints for the prompt."""
    args = ["generate", "--model", str(model), "--chat", "--prompt", prompt, "--seed", str(seed)]
    args += ["--max-new-tokens", str(max_new_tokens), "--temperature", "0.7"]
    args += ["--adapter", str(adapter)] if adapter else []
    done = subprocess.run([sys.executable, "-m", "lora_llama", *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def ask(page, prompt: str, seed: int, max_new_tokens: int) -> None:
    page.fill("#chat-prompt", prompt)
    page.fill("#chat-seed", str(seed))
    page.fill("#chat-max", str(max_new_tokens))
    page.click("#send")
    page.wait_for_selector("#chat-base[data-done=true]", timeout=60_000)
    if page.is_visible("#chat-adapter-pane"):
        page.wait_for_selector("#chat-adapter[data-done=true]", timeout=60_000)


@pytest.mark.slow  # ~100 s: eight chats in the browser, each checked against `lora-llama generate`
@needs_chromium
def test_chat_asks_the_model_alone_and_with_an_adapter_as_generate_does(tiny_ckpt, studio, page, tmp_path):
    runs, url = studio
    tiny_run(tiny_ckpt, runs / "done")
    shutil.copytree(runs / "done" / "adapter", runs / "mine")  # an adapter folder of one's own, under the runs
    page.goto(url)
    page.click("tr.run[data-name=done]")
    page.click("#detail-chats button[data-adapter='done/adapter']")
    page.wait_for_selector("#chat[data-adapter='done/adapter']")
    assert page.input_value("#chat-model") == str(tiny_ckpt)  # the run's own base model
    options = page.eval_on_selector_all("#chat-adapter-path option", "os => os.map((o) => o.value)")
    assert options == ["", "done/adapter", "done/checkpoints/step-3/adapter", "mine"]
    ask(page, "What can you eat?", 3, 64)
    assert page.inner_text("#chat-base").strip() == generated(tiny_ckpt, "What can you eat?", 3, 64) != ""
    with_adapter = generated(tiny_ckpt, "What can you eat?", 3, 64, runs / "done" / "adapter")
    assert page.inner_text("#chat-adapter").strip() == with_adapter
    shot(page, "chat", tmp_path)
    for adapter in ("done/checkpoints/step-3/adapter", "mine"):
        page.select_option("#chat-adapter-path", adapter)
        ask(page, "Who are you?", 5, 12)
        assert page.inner_text("#chat-adapter").strip() == generated(tiny_ckpt, "Who are you?", 5, 12, runs / adapter)
    page.select_option("#chat-adapter-path", "")
    assert page.is_hidden("#chat-adapter-pane")
    ask(page, "Who are you?", 5, 12)
    assert page.inner_text("#chat-base").strip() == generated(tiny_ckpt, "Who are you?", 5, 12)


def test_chat_loads_only_the_models_recipes_name_and_the_adapters_under_the_runs(tiny_ckpt, studio):
    runs, url = studio
    tiny_run(tiny_ckpt, runs / "done")
    chat = {"model": str(tiny_ckpt), "adapter": "done/adapter", "prompt": "hi"}
    for changed, error in (
        ({"model": "/etc"}, "unknown model '/etc': chat loads a model a recipe names or a run wrote"),
        ({"adapter": "../done/adapter"}, f"no adapter '../done/adapter' under {runs}"),
        ({"prompt": " "}, "write a prompt first"),
        ({"seed": "--adapter"}, "seed and max new tokens are whole numbers, temperature a number"),
    ):
        with pytest.raises(urllib.error.HTTPError) as refused:
            StudioClient(url).open("api/chat", {**chat, **changed})
        assert json.loads(refused.value.read()) == {"error": error}
    assert not list(runs.glob(".chat-*.log"))


@needs_chromium
def test_ship_merges_a_finished_run_and_chat_offers_the_merged_model(tiny_ckpt, studio, page, tmp_path, monkeypatch):
    """And a push from the page makes a private repository unless public is ticked."""
    runs, url = studio
    tiny_run(tiny_ckpt, runs / "done")
    page.goto(url)
    page.click("tr.run[data-name=done]")
    page.click("#merge")
    page.wait_for_selector("#ship-output[data-done=true]", timeout=60_000)
    assert page.inner_text("#ship-output").startswith("$ lora-llama merge --base")
    assert "merged into" in page.inner_text("#ship-output")
    assert (runs / "done" / "merged" / "model.safetensors.index.json").is_file()
    page.fill("#repo-id", "not a repo")
    page.click("#push")
    page.wait_for_function("document.getElementById('ship-output').textContent.startsWith('push needs')")
    monkeypatch.delenv("HF_TOKEN", raising=False)  # no login here: the push fails at once, after its command line
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for public, flag in ((False, " --private"), (True, "")):
        page.set_checked("#push-public", public)
        page.fill("#repo-id", "ann/tuned")
        page.click("#push")
        page.wait_for_selector("#ship-output[data-done=true]", timeout=60_000)
        command = page.inner_text("#ship-output").splitlines()[0]
        assert command == f"$ lora-llama push {runs / 'done' / 'adapter'} --repo-id ann/tuned{flag}", command
    page.click("#tab-chat")
    page.wait_for_selector(f"#chat-model option[value='{runs / 'done' / 'merged'}']", state="attached")


def test_a_commands_output_is_pushed_as_it_is_written(studio, monkeypatch):
    """/api/follow: each piece of the log as it is written (a character split across writes kept whole), then
    "end" once the command has ended."""
    from lora_llama.studio.jobs import Jobs

    runs, url = studio
    running = threading.Event()
    running.set()
    monkeypatch.setattr(Jobs, "busy", lambda self, run, what: running.is_set())
    log = runs / ".chat.chat-base.log"
    log.write_text("$ lora-llama generate\n")
    stream = StudioClient(url).open("api/follow?what=chat-base", timeout=20)

    def event() -> list[str]:
        lines = []
        while line := stream.readline().decode().rstrip("\n"):
            lines.append(line)
        return lines

    assert event() == ['data: "$ lora-llama generate\\n"']
    for piece, sent in ((b"Hel", "Hel"), ("lo \u00e9".encode()[:-1], "lo "), (b"\xa9!", "\u00e9!")):
        with open(log, "ab") as f:
            f.write(piece)
        assert event() == ["data: " + json.dumps(sent)]
    running.clear()
    assert event() == ["event: end", "data: {}"]
