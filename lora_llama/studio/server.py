"""`lora-llama studio`: the page and its small JSON API over the standard library's HTTP server. The page is one
HTML file (page.html); the API reads run folders (runs.py), makes runs from the form (form.py), starts and
stops them (jobs.py), and runs chat and ship commands on a finished run's adapter (actions.py). It binds
127.0.0.1; another address needs --auth USER:PASS (HTTP basic auth). Runs are confined to the runs folder, and
a run starts from a shipped recipe or a run's own."""

from __future__ import annotations

import base64
import hmac
import json
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from lora_llama.errors import UserError
from lora_llama.recipe.schema import load_recipe
from lora_llama.studio.actions import chat_commands, ship_command
from lora_llama.studio.form import fields, flat_values, plan
from lora_llama.studio.jobs import Jobs
from lora_llama.studio.runs import detail, list_runs, log_path, output_lines
from lora_llama.training.run_folder import RECIPE

PAGE = Path(__file__).with_name("page.html")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def base_recipes(runs: Path) -> dict[str, str]:
    """{label: path} of the recipes a run may start from: the shipped ones (recipes/ here or in the checkout the
    package runs from), then each run's resolved recipe."""
    shipped = {}
    for folder in (Path.cwd() / "recipes", Path(__file__).resolve().parents[2] / "recipes"):
        for f in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            shipped.setdefault(f"recipes/{f.name}", str(f))
    own = {f"run {p.parent.name}": str(p) for p in sorted(runs.glob(f"*/{RECIPE}"))}
    return {**shipped, **own}


class Studio:
    """What the API answers, for one runs folder."""

    def __init__(self, runs: Path):
        self.runs, self.jobs = runs.resolve(), Jobs(runs.resolve())

    def run_folder(self, name: str) -> Path:
        run = self.runs / name
        if not name or "/" in name or name.startswith(".") or run.resolve().parent != self.runs:
            raise UserError(f"no run {name!r} in {self.runs}")
        return run

    def base(self, label: str) -> str:
        bases = base_recipes(self.runs)
        if label not in bases:
            raise UserError(f"unknown base recipe {label!r}")
        return bases[label]

    def get(self, path: str, query: dict) -> dict | list:
        if path == "/api/runs":
            return list_runs(self.runs) if self.runs.is_dir() else []
        if path == "/api/run":
            return detail(self.run_folder(query.get("name", "")))
        if path == "/api/output":  # a chat or ship command's output so far, and whether it still runs
            run, what = self.run_folder(query.get("name", "")), query.get("what", "")
            if what not in ("chat-base", "chat-adapter", "ship"):
                raise UserError(f"no output {what!r}")
            log = log_path(run, what)
            lines = output_lines(log)[1:] if log.is_file() else []  # the first line is the command
            return {"lines": lines, "running": self.jobs.busy(run, what)}
        if path == "/api/form":
            bases = base_recipes(self.runs)
            label = query.get("base") or next(iter(bases))
            return {"fields": fields(), "values": flat_values(load_recipe(self.base(label))), "bases": list(bases)}
        raise UserError(f"no such page {path}")

    def post(self, path: str, body: dict) -> dict:
        if path in ("/api/plan", "/api/start"):
            base = self.base(body.get("base", ""))
            made = plan(base, body.get("values", {}), self.runs, body.get("name", ""))
            if path == "/api/start" and "error" not in made:
                self.jobs.start(self.run_folder(body["name"]), ["train", base, *made["overrides"]])
            return made
        run = self.run_folder(body.get("name", ""))
        if path == "/api/chat":
            made = chat_commands(
                run,
                str(body.get("prompt", "")),
                int(body.get("seed", 0)),
                int(body.get("max_new_tokens", 64)),
                float(body.get("temperature", 0.7)),
            )
            for what, command in made.items():
                self.jobs.start(run, command, what)
        elif path == "/api/ship":
            self.jobs.start(run, ship_command(run, str(body.get("action", "")), str(body.get("repo_id", ""))), "ship")
        elif path == "/api/stop":
            self.jobs.stop(run)
        elif path == "/api/resume":
            self.jobs.start(run, self.jobs.command_of(run))
        else:
            raise UserError(f"no such action {path}")
        return {"ok": True}


class Handler(BaseHTTPRequestHandler):
    studio: Studio
    auth: str | None = None

    def log_message(self, *args):  # the terminal shows the studio's address, not every request
        pass

    def _allowed(self) -> bool:
        if self.auth is None:
            return True
        given = self.headers.get("Authorization", "")
        expected = "Basic " + base64.b64encode(self.auth.encode()).decode()
        if hmac.compare_digest(given, expected):
            return True
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="lora-llama studio"')
        self.end_headers()
        return False

    def _send(self, code: int, payload, content_type="application/json"):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def _answer(self, work):
        try:
            self._send(200, work())
        except UserError as e:
            self._send(400, {"error": str(e)})

    def do_GET(self):
        if not self._allowed():
            return
        url = urlparse(self.path)
        if url.path == "/":
            self._send(200, PAGE.read_bytes(), "text/html; charset=utf-8")
            return
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self._answer(lambda: self.studio.get(url.path, query))

    def do_POST(self):
        if not self._allowed():
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self._answer(lambda: self.studio.post(urlparse(self.path).path, body))


def serve(runs: Path, host: str = "127.0.0.1", port: int = 7860, auth: str | None = None, ready=None) -> None:
    """Serve the studio until interrupted; ready(url) is called once it listens."""
    if host not in LOOPBACK and not auth:
        raise UserError(f"--host {host} serves the studio beyond this machine: give --auth USER:PASS too")
    if auth is not None and ":" not in auth:
        raise UserError("--auth takes USER:PASS")
    runs.mkdir(parents=True, exist_ok=True)
    handler = type("StudioHandler", (Handler,), {"studio": Studio(runs), "auth": auth})
    server = ThreadingHTTPServer((host, port), partial(handler))
    url = f"http://{host}:{server.server_address[1]}/"
    (ready or print)(url)
    try:
        server.serve_forever()
    finally:
        server.server_close()
