"""lora-llama studio in a real browser (Debian's chromium, driven by Playwright): a finished run's curves, a run
started from the form that trains as the CLI does, a run stopped with its checkpoint, a bad value's one-line
error with nothing started; and the server's refusals."""

import json
import shutil
import threading
import time
from urllib.parse import urlparse

import pytest
from safetensors.torch import load_file
from studio_page import needs_chromium, shot, tiny_run

from lora_llama.errors import UserError
from lora_llama.studio.client import StudioClient
from lora_llama.studio.server import serve

pytestmark = needs_chromium


def test_a_finished_run_shows_its_curves_and_recipe(tiny_ckpt, studio, page, tmp_path):
    """Among 50 runs the page lists at once (in under 2 s)."""
    runs, url = studio
    tiny_run(tiny_ckpt, runs / "done", 'eval.prompts=["What can you eat?"]', "eval.max_new_tokens=8")
    (runs / "done" / "eval").mkdir()
    for step, acc in ((0, 0.25), (3, 0.375)):  # what eval.tasks writes: lm-eval's results, the base's at step 0
        results = {"results": {"arc_easy": {"alias": "arc_easy", "acc,none": acc, "acc_stderr,none": 0.01}}}
        (runs / "done" / "eval" / f"lm-eval-step-{step}.json").write_text(json.dumps(results))
    for i in range(49):
        shutil.copytree(runs / "done", runs / f"other-{i:02d}", ignore=shutil.ignore_patterns("checkpoints"))
    start = time.perf_counter()
    page.goto(url)
    page.wait_for_selector("tr.run[data-name=done]")
    assert time.perf_counter() - start < 2.0 and page.locator("tr.run").count() == 50
    assert "finished" in page.inner_text("tr.run[data-name=done]")
    page.click("tr.run[data-name=done]")
    page.wait_for_selector("#detail svg.chart polyline")
    assert page.get_attribute("#detail svg.chart", "data-keys") == "loss"
    assert "eval_loss" in page.inner_html("#detail")
    table = page.inner_text("#benchmarks")
    assert "base\tstep 3" in table and "arc_easy\tacc,none\t0.2500\t0.3750" in table, table
    assert f"dir: {runs / 'done'}" in page.inner_text("#detail-recipe")
    written = [json.loads(line) for line in (runs / "done" / "samples.jsonl").read_text().splitlines()]
    shown = [row.split("\t") for row in page.inner_text("#samples").split("\n")[1:]]  # newest step first
    assert shown == [[str(w["step"]), "What can you eat?", w["samples"]["What can you eat?"]] for w in written[::-1]]
    assert [w["step"] for w in written] == [0, 3]
    assert page.inner_text("#detail-chats") == "chat with the adapter step 3"
    shot(page, "runs", tmp_path)


def new_run_form(page, url, name: str) -> None:
    """The New run tab opened from the finished run `done`'s recipe, the run named `name`."""
    page.goto(url)
    page.click("#tab-new")
    page.select_option("#base", "run done")
    page.wait_for_selector("#fields[data-base='run done']")
    page.fill("#run-name", name)


def test_a_run_started_from_the_form_trains_as_the_cli_does(tiny_ckpt, studio, page, tmp_path):
    runs, url = studio
    tiny_run(tiny_ckpt, runs / "done")
    new_run_form(page, url, "fresh")
    page.fill("[data-path='train.lr']", "0.002")
    page.wait_for_function("document.getElementById('command').textContent.includes('train.lr=0.002')")
    command = page.inner_text("#command")
    assert command.endswith(f"train.lr=0.002 output.dir={runs / 'fresh'}"), command
    page.evaluate("window.scrollTo(0, 0)")
    shot(page, "new-run", tmp_path)
    page.click("#start")
    page.wait_for_selector("#detail[data-name=fresh][data-status=finished]", timeout=120_000)
    (tmp_path / "cli-runs").mkdir()
    tiny_run(tiny_ckpt, tmp_path / "cli-runs" / "cli", "train.lr=0.002", process=True)
    ours, cli = (
        load_file(r / "adapter" / "adapter_model.safetensors") for r in (runs / "fresh", tmp_path / "cli-runs" / "cli")
    )
    assert ours.keys() == cli.keys() and all((ours[k] == cli[k]).all() for k in ours)


def test_a_bad_value_is_the_clis_one_line_and_starts_nothing(tiny_ckpt, studio, page):
    """On the form as it opens: from the default recipe."""
    runs, url = studio
    page.goto(url)
    page.click("#tab-new")
    page.wait_for_function("document.getElementById('command').textContent.includes('lora-llama train')")
    assert page.input_value("#base") == "recipes/smollm2-chat-cpu.yaml"  # the default recipe, which trains anywhere
    page.fill("#run-name", "bad")
    page.fill("[data-path='train.lr']", "-1")
    page.wait_for_function("document.getElementById('form-error').textContent.length > 0")
    assert page.inner_text("#form-error") == "recipe key 'train.lr': Input should be greater than 0 (got -1)"
    page.click("#start")
    time.sleep(0.5)
    assert not (runs / "bad").exists() and not list(runs.glob(".bad*"))


def test_stop_ends_a_run_with_its_checkpoint_and_resume_continues_from_it(tiny_ckpt, studio, page, tmp_path):
    runs, url = studio
    tiny_run(tiny_ckpt, runs / "done")
    new_run_form(page, url, "long")
    page.fill("[data-path='train.max_steps']", "100000")
    page.fill("[data-path='train.save_every']", "100000")
    page.fill("[data-path='train.eval_every']", "100000")  # no eval lines pushing the resume's out of sight
    page.wait_for_function("document.getElementById('command').textContent.includes('train.max_steps=100000')")
    page.click("#start")
    page.wait_for_selector("#detail[data-name=long][data-status=running] #stop", timeout=60_000)
    page.wait_for_function("Number(document.getElementById('detail-step').textContent) > 2", timeout=60_000)
    page.click("#stop")
    page.wait_for_selector("#detail[data-name=long][data-status=stopped]", timeout=60_000)
    [saved] = (runs / "long" / "checkpoints").glob("step-*")
    assert "stopped by SIGTERM" in page.inner_text("#detail-log")
    shot(page, "stopped", tmp_path)
    page.click("#resume")
    page.wait_for_selector("#detail[data-name=long][data-status=running] #stop", timeout=60_000)
    log, deadline = runs / ".long.train.log", time.monotonic() + 60  # the run takes its lock, then loads and says
    while f"resuming from {saved}" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"resuming from {saved}" in log.read_text()
    page.click("#stop")
    page.wait_for_selector("#detail[data-name=long][data-status=stopped]", timeout=60_000)


def test_the_server_refuses_another_address_without_auth(tmp_path):
    with pytest.raises(UserError, match="--auth USER:PASS"):
        serve(tmp_path, "0.0.0.0", 0)


def test_a_run_that_fails_shows_the_clis_one_line(tiny_ckpt, studio, page):
    runs, url = studio
    tiny_run(tiny_ckpt, runs / "done")
    new_run_form(page, url, "broken")
    page.fill("[data-path='data.source']", "missing.jsonl")
    page.wait_for_function("document.getElementById('command').textContent.includes('missing.jsonl')")
    page.click("#start")
    page.wait_for_selector("#detail[data-name=broken][data-status=failed]", timeout=60_000)
    assert page.inner_text("#detail-status").startswith("failed: data source not found: 'missing.jsonl'")
    assert "failed: data source not found" in page.inner_text("tr.run[data-name=broken]")


def test_auth_guards_every_page_and_call(tmp_path):
    """--auth USER:PASS: without the credentials, 401 and nothing read; with them (and the token), the page and the
    API."""
    import base64
    import urllib.error
    import urllib.request

    ready = []
    kwargs = {"auth": "ann:secret", "ready": ready.append}
    threading.Thread(target=serve, args=(tmp_path, "127.0.0.1", 0), kwargs=kwargs, daemon=True).start()
    while not ready:
        time.sleep(0.05)
    client = StudioClient(ready[0])
    for path in ("", "api/runs"):
        with pytest.raises(urllib.error.HTTPError, match="401"):
            client.open(path)
        request = client.request(path)
        request.add_header("Authorization", "Basic " + base64.b64encode(b"ann:secret").decode())
        request.add_header("Cookie", f"lora-llama-studio-{urlparse(ready[0]).port}={client.token}")
        assert urllib.request.urlopen(request).status == 200


def test_two_studios_on_one_runs_folder_never_run_one_run_twice(tiny_ckpt, studio):
    """The second studio meets the run folder's lock: one line, nothing started; the first one stops its run."""
    import urllib.error

    from lora_llama.studio.runs import is_running

    runs, url = studio
    tiny_run(tiny_ckpt, runs / "done")
    other = []
    threading.Thread(target=serve, args=(runs, "127.0.0.1", 0), kwargs={"ready": other.append}, daemon=True).start()
    while not other:
        time.sleep(0.05)
    long = {"train.max_steps": "100000", "train.save_every": "100000", "train.eval_every": "100000"}
    start = {"base": "run done", "name": "long", "values": long}
    StudioClient(url).call("api/start", start)
    deadline = time.monotonic() + 60
    while not is_running(runs / "long") and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(urllib.error.HTTPError) as refused:
        StudioClient(other[0]).open("api/start", start)
    assert json.loads(refused.value.read()) == {"error": "long is running already"}
    StudioClient(url).call("api/stop", {"name": "long"})
    while is_running(runs / "long") and time.monotonic() < deadline + 60:
        time.sleep(0.1)
    assert not is_running(runs / "long")
