"""What a web page can do with the door (the launcher's HTTP port, against the real server): a
request naming a host the door is not known by (DNS rebinding of a loopback server) is refused
before any route runs, and every answer forbids framing and MIME sniffing."""

from __future__ import annotations

import json

import pytest

from testing.door_attacks import request
from testing.door_requests import MODEL, alive, grpc_image

SAFETY = {"x-frame-options": "DENY", "content-security-policy": "frame-ancestors 'none'",
          "x-content-type-options": "nosniff"}


def _get(port: int, path: str, host_lines: str) -> tuple[int, dict, bytes]:
    return request(port, f"GET {path} HTTP/1.1\r\n{host_lines}Connection: close\r\n\r\n".encode())


def _safe(headers: dict) -> bool:
    lower = {k.lower(): v for k, v in headers.items()}
    return all(lower.get(k) == v for k, v in SAFETY.items())


@pytest.mark.parametrize("host", ["rebound.example.com", "rebound.example.com:8000", "127.0.0.1.nip.io", "[::2]:1"])
def test_a_foreign_host_is_refused_before_any_route(door, kv, host):
    pid = door.server_pid
    for path in ("/v2/health/ready", "/", f"/v2/models/{MODEL}/config", "/v1/models"):
        status, headers, body = _get(door.http_port, path, f"Host: {host}\r\n")
        assert status == 421 and "Host" in json.loads(body)["error"], (path, status, body[:200])
        assert _safe(headers), headers
    alive(door, pid)
    assert grpc_image(door, kv)


def test_two_host_headers_are_refused(door):
    status, _, _ = _get(door.http_port, "/v2/health/live", "Host: localhost\r\nHost: rebound.example.com\r\n")
    assert status in (400, 421)  # the HTTP parser refuses it first (400), else the guard


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "127.0.0.1:80", "127.8.9.10:1",
                                  "[::1]:8000", "app.localhost"])
def test_loopback_names_are_answered(door, host):
    status, headers, _ = _get(door.http_port, "/v2/health/live", f"Host: {host}\r\n")
    assert status == 200 and _safe(headers), (host, status)


@pytest.mark.parametrize("path", ["/", "/favicon.ico", "/v2/health/live", "/v2/no/such/route", "/status"])
def test_every_answer_forbids_framing_and_sniffing(door, path):
    status, headers, _ = _get(door.http_port, path, "Host: localhost\r\n")
    assert status in (200, 401, 403, 404), (path, status)
    assert _safe(headers), (path, headers)


def test_the_browser_s_icon_is_answered_not_a_404(door):
    status, headers, body = _get(door.http_port, "/favicon.ico", "Host: localhost\r\n")
    lower = {k.lower(): v for k, v in headers.items()}
    assert status == 200 and lower["content-type"] == "image/svg+xml" and body.startswith(b"<svg")
