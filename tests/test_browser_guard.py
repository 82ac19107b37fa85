"""The door's Host allow-list and safety headers, on the real ASGI stack (Starlette's test client
drives the middleware in front of a real route)."""

from __future__ import annotations

import argparse

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from neopp.launcher.door.browser_guard import BrowserGuard, allowed, host_name, parse_hosts
from neopp.launcher.serve_options import ALLOWED_HOSTS_ENV, allowed_hosts


@pytest.mark.parametrize(("header", "name"), [
    ("localhost", "localhost"), ("LocalHost:8000", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("example.com.", "example.com"), ("example.com.:80", "example.com"), ("::1", "::1")])
def test_host_names_lose_their_port_and_case(header, name):
    assert host_name(header) == name


def test_the_allow_list_as_written():
    assert parse_hosts("*") is None and parse_hosts("a.example, *") is None
    names = parse_hosts(" Svc.Example. ,loopback")
    assert names == frozenset({"svc.example", "loopback"})
    assert allowed("svc.example", names) and allowed("127.0.0.5", names) and allowed("::1", names)
    assert not allowed("other.example", names) and not allowed("10.0.0.1", names)
    assert not allowed("localhost", frozenset({"svc.example"}))
    with pytest.raises(ValueError, match="empty"):
        parse_hosts(" , ")


def _ns(host: str, given: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(host=host, allowed_hosts=given)


def test_the_default_follows_the_bind_address(monkeypatch):
    monkeypatch.delenv(ALLOWED_HOSTS_ENV, raising=False)
    assert allowed_hosts(_ns("127.0.0.1")) == frozenset({"loopback"})
    assert allowed_hosts(_ns("0.0.0.0")) is None  # beyond loopback the API key guards every route
    assert allowed_hosts(_ns("0.0.0.0", "neopp.svc,loopback")) == frozenset({"neopp.svc", "loopback"})
    monkeypatch.setenv(ALLOWED_HOSTS_ENV, "neopp.example")
    assert allowed_hosts(_ns("127.0.0.1")) == frozenset({"neopp.example"})
    assert allowed_hosts(_ns("127.0.0.1", "*")) is None  # the option wins over the environment


def test_the_guard_refuses_and_marks_every_answer():
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("hi"))])
    client = TestClient(BrowserGuard(app, parse_hosts("loopback,neopp.example")), base_url="http://localhost")
    for host, status in (("localhost", 200), ("neopp.example:80", 200), ("evil.example", 421)):
        answer = client.get("/", headers={"Host": host})
        assert answer.status_code == status, host
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["content-security-policy"] == "frame-ancestors 'none'"
    assert client.get("/nothing", headers={"Host": "localhost"}).headers["x-frame-options"] == "DENY"
