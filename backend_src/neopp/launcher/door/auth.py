"""Who may use what on the door: the API key for inference, the operator key for administration,
and the shared-memory regions each client registered here.

One key policy: with an API key set (always beyond loopback), every inference route wants
``Authorization: Bearer <key>`` (``/v1``, ``infer``, ``generate``, ``generate_stream``; Triton's
gRPC inference the same value through its restricted-protocol option); health stays open. The
routes Triton restricts to the operator key are refused here already, before a body is read.
A request may name a shared-memory region only if its client (address) registered that region
through this door, with the operator key; the door's own region and regions registered over
gRPC (the LightLLM client's) are never among them.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from ..admin import KEY_HEADER
from .door_error import DoorError

KEY_FORMAT = re.compile(r"^[A-Za-z0-9_-]{16,256}$")
RESTRICTED = f"This API is restricted, expecting header '{KEY_HEADER}'"  # Triton's own words


def bearer(headers: Any) -> str:
    given = headers.get("authorization", "")
    return given[7:].strip() if given[:7].lower() == "bearer " else ""


def has_api_key(headers: Any, api_key: str | None) -> bool:
    return api_key is None or secrets.compare_digest(bearer(headers).encode(), api_key.encode())


def require_api_key(headers: Any, api_key: str | None) -> None:
    if not has_api_key(headers, api_key):
        raise DoorError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", reason="api_key",
                        headers={"WWW-Authenticate": "Bearer"})


def admin_key(headers: Any) -> str | None:
    """The operator key header, passed on only when it has the key's form."""
    key = headers.get(KEY_HEADER)
    return key if key is not None and KEY_FORMAT.match(key) else None


def has_admin_key(headers: Any, key: str | None) -> bool:
    given = admin_key(headers)
    return key is None or (given is not None and secrets.compare_digest(given.encode(), key.encode()))


def require_admin_key(headers: Any, key: str | None) -> None:
    if not has_admin_key(headers, key):
        raise DoorError(403, RESTRICTED, reason="admin_key")


class ClientRegions:
    """Shared-memory regions registered through this door, and the client address of each."""

    def __init__(self) -> None:
        self.owners: dict[tuple[str, str], str] = {}  # (kind, name) -> client

    def registered(self, kind: str, name: str, client: str) -> None:
        self.owners[(kind, name)] = client

    def unregistered(self, kind: str, name: str | None) -> None:
        """One region gone, or every region of ``kind`` (None)."""
        for key in [k for k in self.owners if k[0] == kind and name in (None, k[1])]:
            del self.owners[key]

    def check(self, names: set[str], client: str, with_key: bool) -> None:
        """A 403 unless every region named is this client's, and the request carries the key."""
        for name in sorted(names):
            if not with_key:
                raise DoorError(403, f"shared-memory parameters (region '{name[:64]}') need the operator key "
                                f"'{KEY_HEADER}', as registering the region did", reason="shm_region")
            if client not in (owner for (_, region), owner in self.owners.items() if region == name):
                raise DoorError(403, f"shared-memory region '{name[:64]}' was not registered through this port by "
                                "this client; a request may name only the regions its client registered here",
                                reason="shm_region")
