"""The studio's API from Python, as its own page calls it: the token of the URL the studio printed, the studio's
own Origin on a POST, JSON bodies. For scripts and benchmarks that drive a studio without a browser."""

from __future__ import annotations

import json
import urllib.request
from urllib.parse import parse_qs, urlparse


class StudioClient:
    """Requests to one studio, from the URL it printed (http://HOST:PORT/?token=T)."""

    def __init__(self, printed_url: str):
        url = urlparse(printed_url)
        self.origin = f"{url.scheme}://{url.netloc}"
        self.token = parse_qs(url.query).get("token", [""])[-1]

    def request(self, path: str, body: dict | None = None) -> urllib.request.Request:
        """A GET of path (with its query), or a POST of body as JSON."""
        data = None if body is None else json.dumps(body).encode()
        method = "GET" if data is None else "POST"
        request = urllib.request.Request(f"{self.origin}/{path.lstrip('/')}", data, method=method)
        request.add_header("Authorization", f"token {self.token}")
        if data is not None:
            request.add_header("Origin", self.origin)
            request.add_header("Content-Type", "application/json")
        return request

    def open(self, path: str, body: dict | None = None, timeout: float = 60):
        """The response (urllib's HTTPError for a 4xx answer, whose body is {"error": one line})."""
        return urllib.request.urlopen(self.request(path, body), timeout=timeout)

    def call(self, path: str, body: dict | None = None) -> dict:
        """The answer's JSON."""
        with self.open(path, body) as response:
            return json.loads(response.read())
