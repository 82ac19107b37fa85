"""What a browser must not be able to do with the door: reach it under a name that is not its own,
or show its pages inside another site's frame.

A web page cannot read answers from another origin, but DNS rebinding gives it one: a name the
attacker controls first points at their server, then at 127.0.0.1, and the page's later requests
reach a keyless loopback server as same-origin. Every such request carries the attacker's name in
``Host``, so the door answers only the names it is known by (``allowed_hosts``): a request naming
another host is refused before any route runs. Every answer also forbids framing (clickjacking the
playground) and MIME sniffing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .responses import json_response

LOOPBACK = "loopback"  # every loopback name and address: localhost, 127.0.0.0/8, ::1
ANY = "*"
SAFETY_HEADERS = ((b"x-frame-options", b"DENY"), (b"content-security-policy", b"frame-ancestors 'none'"),
                  (b"x-content-type-options", b"nosniff"))


def parse_hosts(text: str) -> frozenset[str] | None:
    """A comma-separated allow-list as the operator writes it; None: any host (``*``)."""
    names = frozenset(n.strip().lower().rstrip(".") for n in text.split(",") if n.strip())
    if not names:
        raise ValueError("the allowed hosts are empty: name at least one, 'loopback' or '*'")
    return None if ANY in names else names


def host_name(header: str) -> str:
    """``Host``'s name without its port: ``[::1]:8000`` → ``::1``, ``Example.com.:80`` → ``example.com``."""
    if header.startswith("["):
        return header[1:header.find("]")].lower() if "]" in header else header.lower()
    return header.rsplit(":", 1)[0].lower().rstrip(".") if header.count(":") == 1 else header.lower().rstrip(".")


def is_loopback(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed(name: str, names: Iterable[str] | None) -> bool:
    if names is None:
        return True
    return name in names or (LOOPBACK in names and is_loopback(name))


class BrowserGuard:
    """ASGI middleware: the Host allow-list on every request, the safety headers on every answer."""

    def __init__(self, app: ASGIApp, names: frozenset[str] | None) -> None:
        self.app, self.names = app, names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_safe(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SAFETY_HEADERS]}
            await send(message)

        hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        if len(hosts) > 1 or (hosts and not allowed(host_name(hosts[0]), self.names)):
            answer = json_response(421, {"error": "Host: this server answers only the names it is known by "
                                                  "(the launcher's --allowed-hosts); the request named another"},
                                   {"Connection": "close"})
            await answer(scope, receive, send_safe)
            return
        await self.app(scope, receive, send_safe)
