"""The gRPC front's open calls: at most so many in all and per client, idle ones given up first.

Why: a call holds a slot from its opening, and a client can open calls that send nothing (a
unary call whose message never comes, a stream with no request in flight) for as long as it
likes. As the HTTP door does with idle connections, a call over a cap replaces the call idle
longest (of the same client at its own cap), which ends RESOURCE_EXHAUSTED saying so; with none
idle the new call is refused RESOURCE_EXHAUSTED. gRPC's health check counts in neither cap, so a
probe is always answered.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass(eq=False)
class OpenCall:
    """One call: its client, its task (cancelled if it is given up), and whether it is idle."""

    client: str
    task: asyncio.Task | None
    idle_since: float | None = field(default_factory=time.monotonic)  # None: busy
    given_up: str | None = None  # why it was given up for another call

    def busy(self) -> None:
        self.idle_since = None

    def idle(self) -> None:
        if self.idle_since is None:
            self.idle_since = time.monotonic()


class OpenCalls:
    """The front's calls, counted on its event loop (one thread: no lock)."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self._calls: dict[int, OpenCall] = {}
        self._clients: Counter[str] = Counter()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._calls)

    def enter(self, client: str) -> tuple[int, OpenCall] | str:
        """The new call of ``client`` (and its key), or why it is refused."""
        if self._clients[client] >= self.per_client and not self._give_up(client):
            return (f"this client has {self._clients[client]} gRPC calls open, the most one client may have "
                    f"({self.per_client}), and none idle; retry once some have ended")
        if len(self._calls) >= self.total and not self._give_up(None):
            return (f"the server has {len(self._calls)} gRPC calls open ({self.total} at most) and none idle; "
                    "retry shortly")
        key, call = next(self._ids), OpenCall(client, asyncio.current_task())
        self._calls[key] = call
        self._clients[client] += 1
        return key, call

    def leave(self, key: int) -> None:
        call = self._calls.pop(key, None)
        if call is not None:
            self._clients[call.client] -= 1
            if self._clients[call.client] <= 0:
                del self._clients[call.client]

    def _give_up(self, client: str | None) -> bool:
        """Cancel the call idle longest (of ``client``, or of anyone); False when none is idle."""
        idle = [(call.idle_since, key) for key, call in self._calls.items()
                if call.idle_since is not None and (client is None or call.client == client)]
        if not idle:
            return False
        key = min(idle)[1]
        call = self._calls[key]
        self.leave(key)
        call.given_up = ("given up for a newer call: the open gRPC calls were at their cap and this one, idle "
                         "longest, had no request in flight")
        if call.task is not None:
            call.task.cancel()
        return True
