"""Each client's share of the server: its generations in flight (running and queued) are bounded,
and it waits in a lane of its own, which the models' step schedulers serve in turn.

A client is the address the door sees. One API key is shared by every client of a server, so a
key tells no one apart; behind a proxy every request has the proxy's address, so the door should
face the clients (or the limit be raised). The lane and the label ``/status`` shows are keyed
hashes of the address under a secret drawn at each start: neither names the client, and the
lane cannot be guessed from the label.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...contract.client_lanes import PRIORITY_LEVELS
from .door_error import DoorError

if TYPE_CHECKING:
    from starlette.requests import Request

RETRY_AFTER_S = 1  # a 320x320 demo image takes about a second; a real one longer
SHOWN = 10  # clients /status lists, the busiest first


def client_of(request: Request) -> str:
    """The client a request counts for: the address the door sees."""
    return request.client.host if request.client else ""


@dataclass(frozen=True)
class Turn:
    """Where a request waits: its client's lane in the model's scheduler, and its priority in
    Triton's queue before it (1 for a client's first generation in flight, then 2, ...)."""

    lane: str
    priority: int

    def nth(self, index: int) -> Turn:
        """The turn of the request's ``index``-th generation (an images request's image): each
        counts as one more the client has in flight."""
        return Turn(self.lane, min(self.priority + index, PRIORITY_LEVELS))


class ClientLoad:
    """Generations in flight per client, at most ``limit`` each (0: no limit). The HTTP door and
    the gRPC front count in one table, each from its own thread."""

    def __init__(self, limit: int, secret: bytes | None = None) -> None:
        self.limit = limit
        self._secret = secret or secrets.token_bytes(32)
        self.held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, client: str, count: int = 1) -> int:
        """Count ``count`` more generations for ``client``, or refuse them all (429); the priority
        of the first of them in Triton's queue."""
        with self._lock:
            held = self.held.get(client, 0)
            if self.limit and held + count > self.limit:
                raise DoorError(429, f"this client has {held} generation(s) running or queued, and "
                                f"{held + count} would pass the {self.limit} one client may have; retry once "
                                f"some have finished (retry after {RETRY_AFTER_S} s)", reason="client_limit",
                                headers={"Retry-After": str(RETRY_AFTER_S)})
            self.held[client] = held + count
            return min(held + 1, PRIORITY_LEVELS)

    def give(self, client: str, count: int = 1) -> None:
        with self._lock:
            left = self.held.get(client, 0) - count
            if left > 0:
                self.held[client] = left
            else:
                self.held.pop(client, None)

    def lane(self, client: str) -> str:
        """The lane the door names for ``client``'s requests (``neopp.contract.client_lanes``)."""
        return "door-" + self._mac("lane", client)[:20]

    def label(self, client: str) -> str:
        """How ``/status`` shows ``client``."""
        return "client-" + self._mac("status", client)[:10]

    def look(self) -> dict[str, Any]:
        """What ``/status`` shows: the limit, how many clients hold work, the busiest of them."""
        with self._lock:
            held = dict(self.held)
        busiest = sorted(held.items(), key=lambda item: -item[1])[:SHOWN]
        return {"limit_per_client": self.limit or None, "clients": len(held),
                "in_flight": sum(held.values()),
                "busiest": [{"client": self.label(c), "in_flight": n} for c, n in busiest]}

    def _mac(self, purpose: str, client: str) -> str:
        return hmac.new(self._secret, f"{purpose}\0{client}".encode(), hashlib.sha256).hexdigest()


class CallGate:
    """At most ``per_client`` calls of one client at a time to a model whose instances each block
    for a whole generation (``neopp_t2i``, four instances): a priority orders that model's queue
    but cannot free an instance, so one client's burst could otherwise hold all of them while
    others wait. A client's other calls wait here, in its own line (the door's event loop only)."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._lines: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}  # client -> (slots, [users])

    @asynccontextmanager
    async def slot(self, client: str) -> AsyncIterator[None]:
        slots, users = self._lines.setdefault(client, (asyncio.Semaphore(self.per_client), [0]))
        users[0] += 1
        try:
            async with slots:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._lines[client]
