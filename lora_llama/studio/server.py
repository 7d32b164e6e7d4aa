"""`lora-llama studio`: the page and its small JSON API over the standard library's HTTP server. The page is an
HTML file (page.html) and its script (page.js); the API reads run folders (runs.py), makes runs from the form
(form.py), starts and stops them (jobs.py), runs chat and ship commands (actions.py), and streams a command's
output as it grows. Every request passes the guard first (guard.py: the token, Host, Origin, a bounded JSON
body). It binds 127.0.0.1; another address needs --auth USER:PASS (HTTP basic auth). Runs are confined to the runs
folder, and a run starts from a shipped recipe or a run's own."""

from __future__ import annotations

import codecs
import json
import re
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlparse

from lora_llama.errors import UserError
from lora_llama.recipe.schema import load_recipe
from lora_llama.studio.actions import SHIP, chat_choices, chat_commands, ship_command
from lora_llama.studio.form import base_recipes, fields, flat_values, plan
from lora_llama.studio.guard import LOOPBACK_NAMES, WILDCARDS, Guard, Refused, body_length, new_token, served_hosts
from lora_llama.studio.jobs import Jobs
from lora_llama.studio.runs import TRAIN, detail, is_running, list_runs
from lora_llama.training.run_folder import log_file

# the page and its script, each a file of its own (page.js is linted: make lint)
FILES = {"/": ("page.html", "text/html; charset=utf-8"), "/page.js": ("page.js", "text/javascript; charset=utf-8")}
# how often a followed log is read: a chat's about a token's time on a small model; a trainer's, a step's at most
CHAT_EVERY_S, OTHER_EVERY_S = 0.1, 0.5
CHAT_SETTINGS = {"seed": 0, "max_new_tokens": 64, "temperature": 0.7}  # generate's, as the page sends them
CHAT_PANES = ("chat-base", "chat-adapter")  # a model alone and with an adapter: one chat at a time per studio


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

    def get(self, path: str, query: dict) -> dict:
        if path == "/api/runs":  # and the open run's page, so that a page watching a run asks once a refresh
            runs = list_runs(self.runs) if self.runs.is_dir() else []
            if "open" not in query:
                return {"runs": runs}
            try:
                return {"runs": runs, "open": detail(self.run_folder(query["open"]))}
            except UserError as e:
                return {"runs": runs, "open": {"error": str(e)}}
        if path == "/api/run":
            return detail(self.run_folder(query.get("name", "")))
        if path == "/api/chat":
            return chat_choices(self.runs)
        if path == "/api/form":
            bases = base_recipes(self.runs)
            label = query.get("base") or next(iter(bases))
            return {"fields": fields(), "values": flat_values(load_recipe(self.base(label))), "bases": list(bases)}
        raise UserError(f"no such page {path}")

    def chat_log(self, pane: str) -> Path:
        """A chat pane's output, in the runs folder (a chat belongs to no run)."""
        return log_file(self.runs / "chat", pane)

    def output(self, query: dict) -> tuple[Path, Callable[[], bool], float]:
        """A command's log, whether it still runs and how often to read it: a run's training or one of its ship
        commands (merge, export, push), or a chat pane."""
        what = query.get("what", "")
        if what in CHAT_PANES:
            return self.chat_log(what), lambda: self.jobs.busy(self.runs, what), CHAT_EVERY_S
        if what not in (TRAIN, *SHIP):
            raise UserError(f"no output {what!r}")
        run = self.run_folder(query.get("name", ""))
        if what == TRAIN:
            return log_file(run, what), lambda: is_running(run) or self.jobs.busy(run, what), OTHER_EVERY_S
        return log_file(run, what), lambda: self.jobs.busy(run, what), OTHER_EVERY_S

    def post(self, path: str, body: dict) -> dict:
        if path in ("/api/plan", "/api/start"):
            base = self.base(str(body.get("base", "")))
            values, name = body.get("values", {}), str(body.get("name", ""))
            if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
                raise UserError("the form's values are a JSON object of strings")
            made = plan(base, values, self.runs, name)
            if path == "/api/start" and "error" not in made:
                self.jobs.start(self.run_folder(name), ["train", base, *made["overrides"]])
            return made
        if path == "/api/chat":
            settings = {k: body.get(k, v) for k, v in CHAT_SETTINGS.items()}
            try:  # numbers, so that no value reaches generate's command line as an option
                settings = {k: type(CHAT_SETTINGS[k])(v) for k, v in settings.items()}
            except (TypeError, ValueError):
                raise UserError("seed and max new tokens are whole numbers, temperature a number") from None
            model, adapter, prompt = (str(body.get(k, "")) for k in ("model", "adapter", "prompt"))
            made = chat_commands(self.runs, model, adapter, prompt, **settings)
            if any(self.jobs.busy(self.runs, what) for what in CHAT_PANES):
                raise UserError("the last chat is still answering")
            for what, command in made.items():
                self.jobs.start(self.runs, command, what, self.chat_log(what))
            return {"panes": list(made)}
        run = self.run_folder(str(body.get("name", "")))
        if path == "/api/ship":  # a push makes a private repository unless the page ticks public
            action, repo_id = str(body.get("action", "")), str(body.get("repo_id", ""))
            command = ship_command(run, action, repo_id, private=body.get("public") is not True)
            if any(self.jobs.busy(run, other) for other in SHIP):  # the ship card runs one command at a time
                raise UserError(f"{run.name}: the last ship command is still running")
            self.jobs.start(run, command, action)
        elif path == "/api/stop":
            self.jobs.stop(run)
        elif path == "/api/resume":
            self.jobs.start(run, self.jobs.command_of(run))
        else:
            raise UserError(f"no such action {path}")
        return {"ok": True}


class Handler(BaseHTTPRequestHandler):
    studio: Studio
    guard: Guard

    def log_message(self, *args):  # the terminal shows the studio's address, not every request
        pass

    def _send(self, code: int, payload, content_type="application/json", headers: dict | None = None):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        for key, value in {"Content-Type": content_type, "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(data)

    def _admitted(self, url) -> dict | None:
        """The request's query when the guard admits it (its body read, for a POST, into self.body); else the
        refusal answered and None. A body refused for its size is never read, and its connection is closed."""
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            self.guard.check(self.command, self.headers, query)
            length = body_length(self.command, self.headers)
        except Refused as e:
            # in the terminal, as Jupyter logs what it blocks: a page or a user trying the studio should be seen
            print(f"lora-llama studio: refused {self.command} {url.path}: {e}", file=sys.stderr, flush=True)
            self.close_connection = self.command == "POST"  # an unread body must not be taken for the next request
            challenge = {"WWW-Authenticate": 'Basic realm="lora-llama studio"'} if e.status == 401 else {}
            self._send(e.status, {"error": str(e)}, headers=challenge)
            return None
        if self.command == "POST":
            try:
                self.body = json.loads(self.rfile.read(length) or b"{}")
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                self._send(400, {"error": f"the request body is not JSON: {e}"})
                return None
            if not isinstance(self.body, dict):
                self._send(400, {"error": "the request body is a JSON object"})
                return None
        return query

    def _answer(self, work):
        try:
            self._send(200, work())
        except UserError as e:
            self._send(400, {"error": str(e)})

    def do_GET(self):
        url = urlparse(self.path)
        query = self._admitted(url)
        if query is None:
            return
        if url.path == "/" and "token" in query:  # the first visit: the token kept as a cookie, out of the address bar
            self._send(302, b"", "text/plain", {"Location": "/", "Set-Cookie": self.guard.cookie()})
            return
        if url.path in FILES:
            name, content_type = FILES[url.path]
            self._send(200, Path(__file__).with_name(name).read_bytes(), content_type)
            return
        if url.path == "/api/follow":
            try:
                log, running, every_s = self.studio.output(query)
            except UserError as e:
                self._send(400, {"error": str(e)})
                return
            self._follow(log, running, every_s)
            return
        self._answer(lambda: self.studio.get(url.path, query))

    def _follow(self, log: Path, running: Callable[[], bool], every_s: float) -> None:
        """A command's output as server-sent events while it grows: each new piece of text as it is written (a
        generate's tokens, a trainer's lines), then "end" once the command has ended and its last text is sent."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        decoder, offset = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0
        try:
            while True:
                alive = running()  # asked before reading, so that the text written before it ended is sent
                size = log.stat().st_size if log.is_file() else 0
                if size < offset:  # the log was started again: a new command
                    decoder.reset()
                    offset = 0
                    self.wfile.write(b"event: restart\ndata: {}\n\n")
                if size > offset:
                    with open(log, "rb") as f:
                        f.seek(offset)
                        piece = f.read(size - offset)
                    offset = size
                    self.wfile.write(b"data: " + json.dumps(decoder.decode(piece)).encode() + b"\n\n")
                    self.wfile.flush()
                if not alive:
                    self.wfile.write(b"event: end\ndata: {}\n\n")
                    return
                time.sleep(every_s)
        except (BrokenPipeError, ConnectionResetError):  # the page closed or moved on
            return

    def do_OPTIONS(self):  # a CORS preflight: another origin's, since the studio's own page never needs one
        if self._admitted(urlparse(self.path)) is not None:
            self._send(405, {"error": "the studio's API takes GET and POST"})

    def do_POST(self):
        url = urlparse(self.path)
        if self._admitted(url) is not None:
            self._answer(lambda: self.studio.post(url.path, self.body))


def serve(
    runs: Path,
    host: str = "127.0.0.1",
    port: int = 7860,
    *,
    auth: str | None = None,
    token: str | None = None,
    allowed_hosts: list[str] | None = None,
    ready=None,
) -> None:
    """Serve the studio until interrupted; ready(url) is called once it listens, with the URL that carries the
    token (made here unless given)."""
    if host not in LOOPBACK_NAMES and not auth:
        raise UserError(f"--host {host} serves the studio beyond this machine: give --auth USER:PASS too")
    if auth is not None and ":" not in auth:
        raise UserError("--auth takes USER:PASS")
    if token is not None and not re.fullmatch(r"[\w.~-]{8,}", token, re.ASCII):  # it travels in a cookie
        raise UserError(
            "--token needs 8 or more letters, digits, '.', '_', '~' or '-' (by default the studio makes one)"
        )
    runs.mkdir(parents=True, exist_ok=True)
    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        raise UserError(f"the studio cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound = server.server_address[1]
    guard = Guard(token or new_token(), bound, auth, served_hosts(host, allowed_hosts or []))
    server.RequestHandlerClass = type("StudioHandler", (Handler,), {"studio": Studio(runs), "guard": guard})
    server.daemon_threads = True  # a page following a long run does not keep the studio from ending
    shown = "127.0.0.1" if host in WILDCARDS else f"[{host}]" if ":" in host else host
    (ready or print)(f"http://{shown}:{bound}/?token={guard.token}")
    try:
        server.serve_forever()
    finally:
        server.server_close()
