"""One server's door over HTTP: the URL setting, the API key, forms, OpenAI-shaped errors, server-sent events.

The URL is the one ``make serve`` prints (``NEOPP_URL``, or ``--url``); a key in ``NEOPP_API_KEY``
is sent as a bearer token. A refusal becomes a ``CliError`` that carries the server's own message,
which is what a person needs to fix the request.
"""

from __future__ import annotations

import http.client
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:8000"  # what `make serve` prints with its default HTTP_PORT
MAX_EVENT = 64 << 20  # one event is at most a few base64 images; a larger one is not this server


class CliError(Exception):
    """A failure to report as ``error: <message>`` and exit with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


ADDRESSES_PATH = "/neopp/addresses"


def server_addresses(url: str) -> tuple[str, str]:
    """(HTTP ``host:port``, gRPC ``host:port``) of the server at ``url`` (``NEOPP_URL``): the gRPC
    one is what the door answers at ``/neopp/addresses``, so one address finds both."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    conn = http.client.HTTPConnection(parts.netloc, timeout=5)
    try:
        conn.request("GET", ADDRESSES_PATH)
        answer = conn.getresponse()
        grpc_address = json.loads(answer.read(4096))["grpc"] if answer.status == 200 else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"{url} did not say its gRPC address ({exc}); is the server running?") from None
    finally:
        conn.close()
    if not isinstance(grpc_address, str):
        raise CliError(f"{url} did not say its gRPC address (HTTP {answer.status}); is it this server?")
    return parts.netloc, grpc_address


@dataclass(frozen=True)
class Form:
    """A ``multipart/form-data`` body: text fields, then files as (field name, file name, bytes)."""

    fields: dict[str, Any]
    files: list[tuple[str, str, bytes]] = field(default_factory=list)

    def encode(self) -> tuple[str, bytes]:
        """The Content-Type (with a boundary no file holds) and the body; values as JSON writes them."""
        boundary = uuid.uuid4().hex
        while any(boundary.encode() in data for _, _, data in self.files):
            boundary = uuid.uuid4().hex
        parts = [_part(boundary, f'name="{_quoted(name)}"', _text(value).encode())
                 for name, value in self.fields.items()]
        parts += [_part(boundary, f'name="{_quoted(name)}"; filename="{_quoted(filename)}"', data,
                        "Content-Type: application/octet-stream\r\n") for name, filename, data in self.files]
        return f"multipart/form-data; boundary={boundary}", b"".join(parts) + f"--{boundary}--\r\n".encode()


def _text(value: Any) -> str:
    """A field's value as the door reads it back: true/false, numbers as JSON writes them, text as it is."""
    return value if isinstance(value, str) else json.dumps(value)


def _quoted(text: str) -> str:
    """A name inside a quoted header parameter, as browsers write one (quotes and line ends escaped)."""
    return text.replace("\\", "\\\\").replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")


def _part(boundary: str, disposition: str, data: bytes, extra: str = "") -> bytes:
    return f"--{boundary}\r\nContent-Disposition: form-data; {disposition}\r\n{extra}\r\n".encode() + data + b"\r\n"


@dataclass(frozen=True)
class Server:
    """Where the door is (scheme, host, port) and the key to send."""

    scheme: str
    host: str
    port: int
    api_key: str | None = None
    timeout: float = 600.0

    @classmethod
    def from_url(cls, url: str | None, timeout: float = 600.0) -> Server:
        """``--url``, else ``NEOPP_URL``, else the default; ``host:port`` alone means http, and a
        trailing ``/v1`` (an OpenAI base URL) is accepted."""
        text = (url or os.environ.get("NEOPP_URL") or DEFAULT_URL).strip()
        parts = urlsplit(text if "//" in text else "http://" + text)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.rstrip("/") not in ("", "/v1"):
            raise CliError(f"the server URL must look like http://HOST:PORT, got {text!r}", 2)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise CliError(f"the server URL has no valid port: {text!r}", 2) from None
        return cls(parts.scheme, parts.hostname, port, os.environ.get("NEOPP_API_KEY") or None, timeout)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def _connection(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.timeout)

    def open(self, method: str, path: str, doc: dict[str, Any] | Form | None = None,
             accept: str = "application/json") -> http.client.HTTPResponse:
        """The response to one request (a JSON document or a form), whatever its status; a server
        that cannot be reached is a CliError."""
        headers = {"Accept": accept}
        body = None
        if isinstance(doc, Form):
            headers["Content-Type"], body = doc.encode()
        elif doc is not None:
            body = json.dumps(doc).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn = self._connection()
        try:
            conn.request(method, path, body=body, headers=headers)
            return conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise CliError(f"no answer from {self.url} ({exc}): is the server running (make serve)? "
                           "Point at another one with --url or NEOPP_URL", 2) from None

    def json(self, method: str, path: str, doc: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON answer of a request that must succeed."""
        resp = self.open(method, path, doc)
        with resp:
            return checked(resp, path)


def checked(resp: http.client.HTTPResponse, path: str) -> dict[str, Any]:
    """The JSON body of a 2xx answer; any other status raises the server's own message."""
    raw = resp.read(MAX_EVENT)
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        doc = None
    if not 200 <= resp.status < 300:
        raise CliError(f"{path}: {resp.status} {error_message(doc, raw)}")
    if not isinstance(doc, dict):
        raise CliError(f"{path}: the server answered something other than a JSON object")
    return doc


def error_message(doc: Any, raw: bytes = b"") -> str:
    """The message of an OpenAI-shaped error (and the parameter it names), else the raw text."""
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        err = doc["error"]
        param = f" (parameter {err['param']})" if err.get("param") else ""
        return f"{err.get('message', '')}{param}"
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return doc["error"]
    return raw.decode(errors="replace").strip()[:2000] or "(no message)"


def events(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON documents of a server-sent event stream, one per event, as they arrive."""
    data: list[bytes] = []
    size = 0
    for line in resp:
        line = line.rstrip(b"\r\n")
        if not line:
            if data:
                yield json.loads(b"\n".join(data))
            data, size = [], 0
        elif line.startswith(b"data:"):
            data.append(line[5:].lstrip())
            size += len(line)
            if size > MAX_EVENT:
                raise CliError(f"an event of more than {MAX_EVENT} bytes: this is not a NeoPP server")
    if data:
        yield json.loads(b"\n".join(data))
