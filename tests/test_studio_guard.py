"""The studio safe by default: a page of another origin, open in the same browser, starts and pushes nothing; a
request with a foreign Host, without the token, with a malformed body or a body announced as 100 GB gets a 4xx, and
the studio serves its own page afterwards; the CLI's mistakes are one line."""

import http.client
import json
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest
from studio_page import ROOT, needs_chromium, tiny_run

from lora_llama.studio.actions import ship_command
from lora_llama.studio.client import StudioClient

# a page of another origin: each way a page can send the studio a request without being the studio's own
FOREIGN_PAGE = """<!doctype html><script>
const studio = new URL(location.hash.slice(1)), results = {};
const start = JSON.stringify({base: "run done", name: "evil", values: {}});
const push = JSON.stringify({name: "done", action: "push", repo_id: "mallory/stolen", public: true});
async function attempt(name, work) {
  try { const r = await work(); results[name] = r.type === "opaque" ? "opaque" : r.status; }
  catch (e) { results[name] = "blocked"; }
}
(async () => {
  const json = {"Content-Type": "application/json"}, credentials = "include";
  await attempt("text/plain start", () => fetch(studio + "api/start", {method: "POST", body: start, credentials}));
  await attempt("json start", () => fetch(studio + "api/start",
    {method: "POST", body: start, headers: json, credentials}));
  await attempt("no-cors push", () => fetch(studio + "api/ship",
    {method: "POST", mode: "no-cors", body: push, headers: json, credentials}));
  await attempt("text/plain push", () => fetch(studio + "api/ship", {method: "POST", body: push, credentials}));
  results["beacon"] = navigator.sendBeacon(studio + "api/ship", push);
  await attempt("read runs", () => fetch(studio + "api/runs", {credentials: "include"}).then((r) => r.json()));
  document.title = "done";
  window.results = results;
})();
</script>"""


@pytest.fixture
def foreign_site(tmp_path):
    """Another web site on this machine: FOREIGN_PAGE served from another local port; its URL."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text(FOREIGN_PAGE)
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=tmp_path / "site"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/index.html"
    server.shutdown()


@needs_chromium
def test_a_page_of_another_origin_starts_and_pushes_nothing(tiny_ckpt, studio, page, foreign_site, capfd):
    """The browser holds the studio's cookie (its own page was opened first, and a page on another port of the same
    host is the same site to a browser): the Origin and the JSON body are what refuse the foreign page. Each of its
    requests reaches the studio (the terminal shows the refusal) and none is answered to the page."""
    runs, url = studio
    tiny_run(tiny_ckpt, runs / "done")
    page.goto(url)
    page.wait_for_selector("tr.run[data-name=done]")
    assert "?token=" not in page.url  # kept as a cookie, out of the address bar
    studio_page = url.split("?")[0]
    page.goto(f"{foreign_site}#{studio_page}")
    page.wait_for_function("document.title === 'done'", timeout=20_000)
    results = page.evaluate("window.results")
    assert results == {
        "text/plain start": "blocked",  # sent (a simple request), its answer not shared with the page
        "json start": "blocked",  # its preflight refused: never sent
        "no-cors push": "opaque",
        "text/plain push": "blocked",
        "beacon": True,  # queued
        "read runs": "blocked",
    }
    deadline, origin = (
        time.monotonic() + 10,
        f"Origin '{urlparse(foreign_site).scheme}://{urlparse(foreign_site).netloc}'",
    )
    refused = {"POST /api/start": 1, "OPTIONS /api/start": 1, "POST /api/ship": 3, "GET /api/runs": 1}
    said = ""
    while time.monotonic() < deadline and sum(said.count(f"refused {r}: {origin}") for r in refused) < 6:
        said += capfd.readouterr().err
        time.sleep(0.1)
    assert {r: said.count(f"refused {r}: {origin} is not the studio's own page") for r in refused} == refused, said
    assert sorted(p.name for p in runs.iterdir()) == [".done.lock", "done", "empty.yaml"]  # no run, no ship log
    page.goto(studio_page)  # the studio's own page, still served, the cookie standing for the token
    page.click("tr.run[data-name=done]")
    page.wait_for_selector("#detail[data-name=done] #ship")


def raw(url: str, method: str, path: str, headers: dict, body: bytes = b"") -> tuple[int, dict]:
    """A request sent as given (http.client sets no Host or Content-Length of its own here); status and JSON."""
    where = urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    for key, value in headers.items():
        connection.putheader(key, value)
    connection.endheaders(body or None)
    response = connection.getresponse()
    answer = response.read()
    connection.close()
    return response.status, json.loads(answer) if answer.startswith(b"{") else {}


def test_requests_not_from_the_studios_page_get_a_4xx_and_the_studio_serves_on(studio):
    runs, url = studio
    client = StudioClient(url)
    host, token = urlparse(url).netloc, {"Authorization": f"token {client.token}"}
    own = {"Host": host, "Origin": client.origin, "Content-Type": "application/json", **token}
    start = json.dumps({"base": "recipes/smollm2-chat-cpu.yaml", "name": "x", "values": {}}).encode()
    for method, headers, body, status, says in (
        ("GET", {"Host": f"evil.example:{urlparse(url).port}", **token}, b"", 403, "Host 'evil.example:"),
        ("GET", {"Host": host}, b"", 403, "open the URL the studio printed"),
        ("GET", {"Host": host, "Authorization": "token wrong"}, b"", 403, "open the URL the studio printed"),
        ("GET", {"Host": host, "Origin": "http://evil.example", **token}, b"", 403, "Origin 'http://evil.example'"),
        ("POST", {**own, "Content-Length": str(len(start)), "Origin": "null"}, start, 403, "studio's own page"),
        ("POST", {k: v for k, v in own.items() if k != "Origin"} | {"Content-Length": "2"}, b"{}", 403, "own page"),
        ("POST", {**own, "Content-Type": "text/plain", "Content-Length": "2"}, b"{}", 415, "JSON bodies"),
        ("POST", {**own, "Content-Length": "9"}, b"{not json", 400, "the request body is not JSON"),
        ("POST", {**own, "Content-Length": "2"}, b"[]", 400, "a JSON object"),
        ("POST", {**own, "Content-Length": "-5"}, b"", 400, "is not a number of bytes"),
        ("POST", {**own, "Content-Length": str(100 * 10**9)}, b"{}", 413, "100000000000 bytes is over"),
        ("POST", own, b"", 411, "Content-Length"),
        ("OPTIONS", {"Host": host, **token}, b"", 405, "takes GET and POST"),  # answered, and with no CORS grant
    ):
        got, answer = raw(url, method, "/api/runs" if method == "GET" else "/api/start", headers, body)
        assert (got, says in answer.get("error", "")) == (status, True), (method, headers, answer)
        assert raw(url, "GET", "/", {"Host": host, **token})[0] == 200  # serving on
    assert not (runs / "x").exists() and not list(runs.glob(".x*"))
    assert client.call("api/plan", json.loads(start))["command"].startswith("lora-llama train")


def test_the_first_visit_keeps_the_token_as_a_cookie(studio):
    """?token= answers a redirect to / with the cookie, which then stands for the token."""
    runs, url = studio
    host, port = urlparse(url).netloc, urlparse(url).port
    where = urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    connection.request("GET", "/?" + where.query)
    response = connection.getresponse()
    response.read()
    cookie = response.getheader("Set-Cookie")
    assert response.status == 302 and response.getheader("Location") == "/"
    assert cookie.startswith(f"lora-llama-studio-{port}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert raw(url, "GET", "/api/runs", {"Host": host, "Cookie": cookie.split(";")[0]}) == (200, {"runs": []})
    assert raw(url, "GET", "/api/runs", {"Host": host, "Cookie": f"lora-llama-studio-{port}=guess"})[0] == 403


def test_a_push_makes_a_private_repository_unless_public_is_ticked(tiny_ckpt, tmp_path):
    tiny_run(tiny_ckpt, tmp_path / "done")
    assert ship_command(tmp_path / "done", "push", "ann/tuned")[-1] == "--private"
    assert "--private" not in ship_command(tmp_path / "done", "push", "ann/tuned", private=False)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--port", "99999"], "argument --port: 99999 is not a port (0 to 65535)"),
        (["--token", "short"], "--token needs 8 or more letters, digits"),
        (["--token", "has;a;semicolon"], "--token needs 8 or more letters, digits"),  # it travels in a cookie
        (["--host", "0.0.0.0"], "--host 0.0.0.0 serves the studio beyond this machine: give --auth USER:PASS too"),
    ],
)
def test_the_studios_mistakes_are_one_line(args, says, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "lora_llama", "studio", "--runs", str(tmp_path / "runs"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_port_in_use_is_one_line(studio, tmp_path):
    port = urlparse(studio[1]).port
    done = subprocess.run(
        [sys.executable, "-m", "lora_llama", "studio", "--runs", str(tmp_path / "runs"), "--port", str(port)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
