"""Which requests may reach the studio, checked as Jupyter's server checks them. The loopback is not a wall: every
page the user's browser has open can send requests to 127.0.0.1 (a text/plain POST needs no CORS preflight), a page
whose host name is rebound to 127.0.0.1 reads the answers, and every user of the machine reaches it. So:

- a token, made at start (or given) and printed in the studio's URL, is required on every request: as `?token=`
  (then kept as a cookie), in the cookie, or as `Authorization: token T`; --auth adds HTTP basic auth beside it;
- the `Host` header names the address the studio serves (a loopback name, the --host given, or --allowed-hosts),
  so a rebound name is refused;
- an `Origin`, where a browser sends one, is the studio's own; a POST must carry one (a missing or "null" Origin
  is refused) and a JSON body (`Content-Type: application/json`), which another origin cannot send without a
  preflight the studio never answers;
- a body is at most MAX_BODY bytes, refused unread above that."""

from __future__ import annotations

import base64
import hmac
import ipaddress
import secrets
import socket
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from urllib.parse import urlparse

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
MAX_BODY = 1 << 20  # the form's largest body is a few kB; 1 MB bounds what a request can make the studio hold


class Refused(Exception):
    """A request the studio does not serve: an HTTP status and one line saying why."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


def new_token() -> str:
    return secrets.token_urlsafe(32)


def _host_name(netloc: str) -> str:
    """The name in a Host header or an origin's netloc, without its port or an IPv6 address's brackets."""
    if netloc.startswith("["):
        return netloc[1 : netloc.find("]")] if "]" in netloc else ""
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass
class Guard:
    """The checks for one studio: its token, its basic auth (USER:PASS or None) and the host names it answers to."""

    token: str
    port: int
    auth: str | None = None
    hosts: tuple[str, ...] = field(default_factory=tuple)  # besides the loopback names

    @property
    def cookie_name(self) -> str:  # browsers share cookies across ports: one cookie per studio's port
        return f"lora-llama-studio-{self.port}"

    def check(self, method: str, headers, query: dict) -> None:
        """Refused unless the request may be served; its body is checked apart (body_length)."""
        host = headers.get("Host", "")
        name = _host_name(host).lower()
        if not (_is_loopback(name) or name in self.hosts):
            raise Refused(403, f"Host {host!r} is not an address this studio serves (see --allowed-hosts)")
        origin = headers.get("Origin")
        if origin is not None or method == "POST":
            if not origin or origin == "null":
                raise Refused(403, "a request that changes anything must come from the studio's own page")
            parsed = urlparse(origin)
            if parsed.scheme not in ("http", "https") or parsed.netloc.lower() != host.lower():
                raise Refused(403, f"Origin {origin!r} is not the studio's own page")
        if self.auth is not None:
            expected = "Basic " + base64.b64encode(self.auth.encode()).decode()
            if not hmac.compare_digest(headers.get("Authorization", "").encode(), expected.encode()):
                raise Refused(401, "this studio asks for a user name and password (--auth)")
        if not any(hmac.compare_digest(given.encode(), self.token.encode()) for given in self._tokens(headers, query)):
            raise Refused(403, "open the URL the studio printed: it carries the token (?token=...)")

    def _tokens(self, headers, query: dict) -> list[str]:
        """The tokens a request carries: in its query, its cookie, its Authorization header."""
        given = [query["token"]] if "token" in query else []
        try:
            morsel = SimpleCookie(headers.get("Cookie", "")).get(self.cookie_name)
        except CookieError:
            morsel = None
        given += [morsel.value] if morsel is not None else []
        scheme, _, value = headers.get("Authorization", "").partition(" ")
        return given + ([value] if scheme.lower() == "token" else [])

    def cookie(self) -> str:
        """The Set-Cookie value that keeps the token after the first visit, for this page alone (not scripts)."""
        return f"{self.cookie_name}={self.token}; Path=/; HttpOnly; SameSite=Strict"


def body_length(method: str, headers) -> int:
    """The body's length in bytes, refused when it is not JSON, not announced, or larger than MAX_BODY."""
    if method != "POST":
        return 0
    if headers.get("Content-Type", "").split(";")[0].strip().lower() != "application/json":
        raise Refused(415, "the studio's API takes JSON bodies (Content-Type: application/json)")
    length = headers.get("Content-Length")
    if length is None:
        raise Refused(411, "a request body needs its Content-Length")
    if not length.strip().isdigit():
        raise Refused(400, f"Content-Length {length!r} is not a number of bytes")
    if int(length) > MAX_BODY:
        raise Refused(413, f"a request body of {int(length)} bytes is over the studio's {MAX_BODY}")
    return int(length)


def served_hosts(host: str, allowed: list[str]) -> tuple[str, ...]:
    """The host names besides the loopback ones that a studio bound to `host` answers to: the address given (for a
    wildcard, this machine's names and addresses), and any --allowed-hosts (a name a proxy or DNS gives it)."""
    names = [host]
    if host in WILDCARDS:
        names = [socket.gethostname(), socket.getfqdn()]
        try:
            names += socket.gethostbyname_ex(socket.gethostname())[2]
        except OSError:  # a machine whose own name does not resolve is reached by the names given
            pass
    return tuple(dict.fromkeys(n.strip().lower() for n in [*names, *allowed] if n.strip()))
