"""`lora-llama push` against a minimal local server that answers the Hub API calls huggingface_hub makes."""

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from helpers import chat_file
from lora_llama import LoraSettings, apply_lora, load_model, save_adapter
from lora_llama.cli import main

TOKEN = "hf_secretTOKENvalue1234567890"
REPO = "alice/tiny-lora"


class FakeHub(BaseHTTPRequestHandler):
    """Records every request; answers only the calls it understands, 404 otherwise."""

    def log_message(self, *a):
        pass

    def _reply(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.server.requests.append(("GET", self.path, self.headers.get("authorization"), b""))
        self._reply(404, {"error": "not found"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append(("POST", self.path, self.headers.get("authorization"), body))
        if self.headers.get("authorization") != f"Bearer {self.server.accepted}":
            return self._reply(401, {"error": "Invalid credentials"})
        path = self.path.split("?")[0]
        prefix = f"/api/models/{REPO}/"
        if path == "/api/repos/create":
            return self._reply(200, {"url": f"{self.server.url}/{REPO}", "name": REPO})
        if path == "/api/validate-yaml":
            meta = yaml.safe_load(json.loads(body)["content"].split("---")[1])
            return self._reply(200 if isinstance(meta, dict) else 400, {"errors": [], "warnings": []})
        if path.startswith(prefix + "preupload/"):
            files = json.loads(body)["files"]
            return self._reply(
                200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if path.startswith(prefix + "commit/"):
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            if lines[0]["key"] != "header" or any(entry["key"] != "file" for entry in lines[1:]):
                return self._reply(400, {"error": "unexpected commit payload"})
            self.server.commits.append(lines)
            return self._reply(
                200,
                {"commitUrl": f"{self.server.url}/{REPO}/commit/abc123", "commitOid": "abc123", "pullRequestUrl": None},
            )
        self._reply(404, {"error": f"no route {path}"})


@pytest.fixture
def hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    server.requests, server.commits, server.accepted = [], [], TOKEN
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(server.url and "/nonexistent-hf-home"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", server.url)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    yield server
    server.shutdown()


@pytest.fixture
def run_dir(tiny_ckpt, tmp_path):
    model = load_model(tiny_ckpt)
    apply_lora(model, LoraSettings(r=4, alpha=8))
    run = tmp_path / "run"
    save_adapter(model, run / "adapter")
    (run / "recipe.yaml").write_text(
        yaml.safe_dump({"data": {"source": "tatsu-lab/alpaca"}, "train": {"lr": 0.001, "max_steps": 5}})
    )
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval_loss": 1.25, "eval_perplexity": 3.49}) + "\n")
    (run / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    return run


def test_push_creates_repo_and_commits_expected_files(hub, run_dir, capsys):
    assert main(["push", str(run_dir), "--repo-id", REPO, "--token", TOKEN]) == 0
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err
    routes = [(m, p.split("?")[0]) for m, p, _, _ in hub.requests]
    assert ("POST", "/api/repos/create") in routes
    assert json.loads(next(b for m, p, _, b in hub.requests if p == "/api/repos/create"))["name"] == "tiny-lora"
    assert len(hub.commits) == 1
    files = {entry["value"]["path"]: base64.b64decode(entry["value"]["content"]) for entry in hub.commits[0][1:]}
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors", "README.md", "loss.png"}
    assert files["adapter_model.safetensors"] == (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()
    card = files["README.md"].decode()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "peft" and meta["pipeline_tag"] == "text-generation"
    assert {"lora", "lora-llama"} <= set(meta["tags"]) and meta["datasets"] == ["tatsu-lab/alpaca"]
    base = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert (
        "base_model" not in meta and base not in card
    )  # a local base: its folder's name only, no path of this machine
    assert "1.2500" in card and "PeftModel.from_pretrained" in card and "lora-llama generate" in card
    # every API call that changes something carries the token (huggingface_hub also makes an anonymous GET)
    assert all(auth == f"Bearer {TOKEN}" for m, _, auth, _ in hub.requests if m == "POST")
    assert TOKEN not in card


def test_unauthorized_exit_2_without_token_in_message(hub, run_dir, capsys):
    hub.accepted = "another-token"
    assert main(["push", str(run_dir / "adapter"), "--repo-id", REPO, "--token", TOKEN]) == 2
    out = capsys.readouterr()
    assert "401" in out.err and REPO in out.err and "write access" in out.err
    assert TOKEN not in out.out + out.err
    assert not hub.commits


def test_token_from_environment_never_printed(hub, run_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["push", str(run_dir), "--repo-id", REPO]) == 0
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err and hub.commits


def test_dry_run_makes_no_request(hub, run_dir, capsys):
    assert main(["push", str(run_dir), "--repo-id", REPO, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "adapter_model.safetensors" in out and "library_name: peft" in out
    assert hub.requests == []


def test_no_token_and_no_adapter(hub, tmp_path, run_dir, capsys):
    assert main(["push", str(run_dir), "--repo-id", REPO]) == 2
    assert "no Hugging Face token" in capsys.readouterr().err
    assert main(["push", str(tmp_path), "--repo-id", REPO, "--token", TOKEN]) == 2
    assert "holds no adapter" in capsys.readouterr().err
    assert hub.requests == []


def test_unreachable_hub(run_dir, capsys, monkeypatch):
    import socket

    import huggingface_hub.constants as c

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(c, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    assert main(["push", str(run_dir), "--repo-id", REPO, "--token", TOKEN]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the Hub" in err and TOKEN not in err


def test_card_of_registered_base_names_hub_model_and_license(run_dir):
    from lora_llama.outputs.hub import model_card

    cfg_path = run_dir / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "base_model_name_or_path": "smollm2-135m-instruct"}))
    meta = yaml.safe_load(model_card(run_dir / "adapter", run_dir, REPO).split("---")[1])
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["license"] == "apache-2.0"


def _train_args(tiny_ckpt, tmp_path) -> list[str]:
    data = chat_file(tmp_path / "d.jsonl", [("hello", "world"), ("the quick", "brown fox")] * 2)
    (tmp_path / "r.yaml").write_text("{}")
    settings = [f"model.source={tiny_ckpt}", f"data.source={data}", f"output.dir={tmp_path / 'run'}", "data.val_size=0"]
    settings += ["train.max_steps=2", "train.precision=fp32", "model.device=cpu", f"output.push_to_hub={REPO}"]
    return ["train", str(tmp_path / "r.yaml"), *settings]


def test_train_pushes_the_final_adapter_after_training(hub, tiny_ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(_train_args(tiny_ckpt, tmp_path)) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["steps"] == 2 and result["pushed"].endswith("/commit/abc123")
    assert len(hub.commits) == 1
    files = {entry["value"]["path"]: base64.b64decode(entry["value"]["content"]) for entry in hub.commits[0][1:]}
    assert (
        files["adapter_model.safetensors"] == (tmp_path / "run" / "adapter" / "adapter_model.safetensors").read_bytes()
    )


def test_train_without_a_token_stops_before_training(hub, tiny_ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    assert main(_train_args(tiny_ckpt, tmp_path)) == 2
    assert "no Hugging Face token" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not hub.requests
