"""The HTTP front relays server-sent events as they arrive (generate_stream), not when the
upstream response ends. The upstream here is a real HTTP server on loopback that sends its
second event only after the client has received the first: a buffering front deadlocks it."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from neopp.ports import LOOPBACK
from neopp.serving.admin import FRONT_HEADER
from neopp.serving.http_front import HttpFront

KEY = "front-key"


class Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__((LOOPBACK, 0), _Events)
        self.first_seen = threading.Event()  # set by the test once the client holds event 1
        self.waited_ok: bool | None = None
        self.key: str | None = None


class _Events(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def log_message(self, *args) -> None:
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.key = self.headers.get(FRONT_HEADER)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(b'data: {"STEP":1}\n\n')
        self.server.waited_ok = self.server.first_seen.wait(10)
        self._chunk(b'data: {"STEP":2}\n\n')
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


@pytest.fixture
def front():
    upstream = Upstream()
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    server = HttpFront(LOOPBACK, 0, upstream.server_address, KEY).start()
    yield server, upstream
    server.stop()
    upstream.shutdown()
    upstream.server_close()


def test_events_are_relayed_as_they_arrive(front):
    server, upstream = front
    conn = http.client.HTTPConnection(*server.server_address, timeout=30)
    conn.request("POST", "/v2/models/m/generate_stream", body=b"{}", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    assert resp.readline() == b'data: {"STEP":1}\n'
    upstream.first_seen.set()
    rest = resp.read()
    conn.close()
    assert upstream.waited_ok is True, "the first event reached the client only after the upstream finished"
    assert rest == b'\ndata: {"STEP":2}\n\n'
    assert upstream.key == KEY  # relayed with the front's key, as every other request
