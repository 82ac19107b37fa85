"""A thin HTTP front that checks inference requests before Triton parses them.

Triton 2.51's HTTP endpoint sizes the buffer of a JSON ``data`` input from the declared
``shape`` alone, before it reads the data: one request declaring ``[1000000000000]`` INT64
makes it allocate 8 TB and abort (``std::bad_alloc``). 2.51 has no option that bounds this nor
the body size. The front refuses, before anything reaches Triton, a body over ``max_body``
bytes (unread, 413) and an infer request whose inputs declare more bytes than ``max_body`` or,
for JSON data, more elements than the body could hold (400). Everything else is relayed
unchanged, with the per-server key that Triton's own HTTP port requires; server-sent events
(``generate_stream``) are relayed as they arrive.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .admin import FRONT_HEADER

EVENT_STREAM = "text/event-stream"
INFER_PATH = re.compile(r"^/v2/models/[^/?]+(/versions/[^/?]+)?/infer(\?.*)?$")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-connection", "host", "content-length", FRONT_HEADER}
DTYPE_BYTES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2,
               "UINT32": 4, "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8, "BYTES": 1}
DEFAULT_MAX_BODY = 128 * 1024 * 1024  # two realistic KV prefixes (~44 MB each) and the rest
DRAIN_LIMIT = 1 << 30  # bodies refused for their size are read and dropped up to this, else cut off


class Refused(ValueError):
    """A request the front answers itself with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _element_count(shape: Any, name: str) -> int:
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise Refused(400, f"input '{name}': shape must be a list of non-negative integers")
    count = 1
    for dim in shape:
        count *= dim
    return count


def check_infer_header(header: dict[str, Any], body_len: int, max_body: int) -> None:
    """Refuse inputs whose declared size no body within ``max_body`` can carry."""
    inputs = header.get("inputs")
    if not isinstance(inputs, list):
        raise Refused(400, "'inputs' must be a list")
    for item in inputs:
        name = str(item.get("name", "?")) if isinstance(item, dict) else "?"
        if not isinstance(item, dict):
            raise Refused(400, "each input must be an object")
        count = _element_count(item.get("shape"), name)
        declared = count * DTYPE_BYTES.get(str(item.get("datatype")), 8)
        if declared > max_body:
            raise Refused(400, f"input '{name}': shape declares {declared} bytes, over the {max_body} limit")
        if "data" in item and count > body_len:  # a JSON element takes at least one byte of text
            raise Refused(400, f"input '{name}': shape declares {count} elements, the body cannot hold them")


def _json_header(body: bytes, header_len: str | None) -> dict[str, Any]:
    try:
        raw = body[: int(header_len)] if header_len else body
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(400, f"malformed inference request header: {exc}") from None
    if not isinstance(header, dict):
        raise Refused(400, "inference request header must be a JSON object")
    return header


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HttpFront

    def log_message(self, *args: Any) -> None:  # Triton logs requests; the front stays quiet
        pass

    def _reply(self, status: int, body: bytes, headers: list[tuple[str, str]] = ()) -> None:
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, exc: Refused) -> None:
        if exc.status == 413:
            self._drain()
        body = json.dumps({"error": str(exc)}).encode()
        self._reply(exc.status, body, [("Content-Type", "application/json")])

    def _drain(self) -> None:
        """Discard a refused body in small chunks (clients then read the answer); close if huge."""
        length = int(self.headers.get("Content-Length") or 0)
        if length > DRAIN_LIMIT:
            self.close_connection = True
            return
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 20))
            if not chunk:
                break
            length -= len(chunk)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise Refused(411, "chunked bodies are not accepted; send Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise Refused(400, "bad Content-Length") from None
        if length < 0 or length > self.server.max_body:
            raise Refused(413, f"body of {length} bytes is over the {self.server.max_body} byte limit")
        return self.rfile.read(length) if length else b""

    def _relay(self) -> None:
        try:
            body = self._read_body()
            if self.command == "POST" and INFER_PATH.match(self.path):
                header = _json_header(body, self.headers.get("Inference-Header-Content-Length"))
                check_infer_header(header, len(body), self.server.max_body)
        except Refused as exc:
            return self._refuse(exc)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        headers[FRONT_HEADER] = self.server.front_key
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=self.server.timeout_s)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_HEADERS]
            if (resp.getheader("Content-Type") or "").startswith(EVENT_STREAM):
                return self._relay_events(resp, kept)
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            return self._reply(502, json.dumps({"error": f"server unavailable: {exc}"}).encode())
        finally:
            conn.close()
        self._reply(resp.status, data, kept)

    def _relay_events(self, resp: http.client.HTTPResponse, headers: list[tuple[str, str]]) -> None:
        """Server-sent events (``generate_stream``) go out as they arrive, one chunk each, never
        buffered: a client sees every progress event when Triton sends it."""
        self.send_response(resp.status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True  # a client gone mid-stream leaves nothing to reuse
        try:
            while chunk := resp.read1(1 << 16):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client left; closing the upstream connection ends the relay
            pass

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _relay


class HttpFront(ThreadingHTTPServer):
    """Listen on ``(host, port)``; relay to Triton's HTTP port at ``upstream``."""

    daemon_threads = True

    def __init__(self, host: str, port: int, upstream: tuple[str, int], front_key: str,
                 max_body: int = DEFAULT_MAX_BODY, timeout_s: float = 3600.0) -> None:
        super().__init__((host, port), _Handler)
        self.upstream, self.front_key = upstream, front_key
        self.max_body, self.timeout_s = max_body, timeout_s
        self._thread: threading.Thread | None = None

    def start(self) -> HttpFront:
        self._thread = threading.Thread(target=self.serve_forever, name="neopp-http-front", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
