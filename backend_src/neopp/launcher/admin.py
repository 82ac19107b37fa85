"""The operator key that guards Triton's administrative APIs, and the API key for inference.

Triton's model-repository API accepts a ``config`` override and ``file:`` contents in a load
request, so anyone who can call it can make the server run Python code of their choice. The
shared-memory API lets a caller map host memory into the server. Both (plus config, trace and
logging) are restricted to callers that send the key in a header; health, metadata and
statistics stay open. With an API key (always beyond loopback) inference needs it too, the
header the HTTP door wants, ``authorization: Bearer <key>``, which Triton's gRPC endpoint reads
with its restricted-protocol prefix: ``triton-grpc-protocol-authorization``.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

KEY_ENV = "NEOPP_ADMIN_KEY"
KEY_HEADER = "neopp-admin-key"  # HTTP header; over gRPC Triton expects it with its protocol prefix
GRPC_HEADER = f"triton-grpc-protocol-{KEY_HEADER}"
RESTRICTED = ("model-repository", "model-config", "shared-memory", "trace", "logging")
FRONT_HEADER = "neopp-front-key"  # what the HTTP front adds; Triton's own HTTP port wants it for all else
FRONT_ONLY = ("inference", "health", "metadata", "statistics")
API_KEY_HEADER = "authorization"
GRPC_API_KEY_HEADER = f"triton-grpc-protocol-{API_KEY_HEADER}"


class AdminKeyError(RuntimeError):
    """The key file is unusable (readable by others, empty)."""


def check_key(key: str, where: str) -> str:
    if len(key) < 16 or not all(c.isalnum() or c in "-_" for c in key):
        raise AdminKeyError(f"{where}: the key must be 16+ characters of [A-Za-z0-9_-]")
    return key


def load_or_create_key(path: Path, env: dict[str, str] | None = None) -> tuple[str, str]:
    """The key and where it came from: ``$NEOPP_ADMIN_KEY``, else ``path`` (created 0600 once)."""
    env = os.environ if env is None else env
    if env.get(KEY_ENV):
        return check_key(env[KEY_ENV].strip(), KEY_ENV), f"${KEY_ENV}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            raise AdminKeyError(f"{path} is readable by group or others; chmod 600 it or remove it") from None
        return check_key(path.read_text().strip(), str(path)), str(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return check_key(path.read_text().strip(), str(path)), str(path)


def new_front_key() -> str:
    """A per-server secret the HTTP front adds, so Triton's own HTTP port is useless without it."""
    return secrets.token_urlsafe(24)


def restriction_args(key: str, front_key: str | None = None, api_key: str | None = None) -> list[str]:
    """tritonserver flags: admin APIs need ``key``; with ``front_key``, HTTP's other APIs need it
    (only the door reaches Triton's HTTP); with ``api_key``, gRPC inference needs it."""
    apis = ",".join(RESTRICTED)
    args = [f"--http-restricted-api={apis}:{KEY_HEADER}={key}",
            f"--grpc-restricted-protocol={apis}:{KEY_HEADER}={key}"]
    if front_key:
        args.append(f"--http-restricted-api={','.join(FRONT_ONLY)}:{FRONT_HEADER}={front_key}")
    if api_key:
        args.append(f"--grpc-restricted-protocol=inference:{API_KEY_HEADER}=Bearer {api_key}")
    return args


def inference_metadata(api_key: str | None) -> list[tuple[str, str]] | None:
    """gRPC metadata of an inference call where the server wants the API key."""
    return [(GRPC_API_KEY_HEADER, f"Bearer {api_key}")] if api_key else None


def http_headers(key: str | None) -> dict[str, str]:
    return {KEY_HEADER: key} if key else {}


def grpc_headers(key: str | None) -> dict[str, str]:
    return {GRPC_HEADER: key} if key else {}
