"""Triton's own HTTP endpoint, where only the launcher can reach it.

Behind the door, Triton's HTTP serves the door's control routes and the launcher's checks,
nothing else. On a TCP port, loopback or not, any local user reaches it, and the port and any
per-run key given to Triton are on its command line, which every local user can read
(``/proc/<pid>/cmdline``). Triton 2.51's HTTP server also binds a Unix socket
(``--http-address=unix:<path>``): the launcher puts it in a directory of its own, mode 0700, so
the file system keeps other users out and no secret is needed. :func:`call` speaks to either
kind of address. Triton's gRPC goes beside it (:func:`grpc_beside`), behind the launcher's gRPC
front (neopp.launcher.door.grpc_front).
"""

from __future__ import annotations

import http.client
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

UNIX = "unix:"
SOCKET_NAME = "http"
GRPC_SOCKET_NAME = "grpc"


def private_address() -> str:
    """``unix:<dir>/http`` in a fresh directory only this user can enter (mkdtemp makes it 0700)."""
    return f"{UNIX}{Path(tempfile.mkdtemp(prefix='neopp_triton_')) / SOCKET_NAME}"


def grpc_beside(http_address: str) -> str:
    """``unix:<dir>/grpc``: Triton's gRPC socket in the private directory of ``http_address``."""
    path = socket_path(http_address)
    if path is None:
        raise ValueError(f"not a socket address: {http_address}")
    return f"{UNIX}{path.parent / GRPC_SOCKET_NAME}"


def socket_path(address: str) -> Path | None:
    """The socket of a ``unix:`` address, else None."""
    return Path(address[len(UNIX):]) if address.startswith(UNIX) else None


def clear_socket(address: str) -> None:
    """Remove a socket a previous server left (Triton does not, and binding over it fails)."""
    path = socket_path(address)
    if path is not None:
        path.unlink(missing_ok=True)


def remove_private(address: str) -> None:
    """Remove the directory :func:`private_address` made, with its socket."""
    path = socket_path(address)
    if path is not None and path.name == SOCKET_NAME and path.parent.name.startswith("neopp_triton_"):
        shutil.rmtree(path.parent, ignore_errors=True)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


def call(address: str, method: str, target: str, headers: Mapping[str, str] | None = None,
         body: bytes | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """One request to ``address`` (``host:port`` or ``unix:<path>``): its status and body.

    Raises OSError (http.client's errors included) when the server cannot be reached or answers
    no valid HTTP."""
    path = socket_path(address)
    conn = _UnixConnection(path, timeout) if path is not None else http.client.HTTPConnection(address, timeout=timeout)
    try:
        conn.request(method, target, body=body, headers=dict(headers or {}))
        response = conn.getresponse()
        return response.status, response.read()
    except http.client.HTTPException as exc:
        raise OSError(f"not an HTTP answer: {exc}") from None
    finally:
        conn.close()
