"""Adapters loaded on a thread of their own, before a request reaches the step loop.

Reading an adapter takes as long as its file (seconds for hundreds of MiB); on the step thread
it would stall every running request. ``AdapterLoader`` takes a ticket whose request names an
adapter, loads it (``AdapterStore.get``: resident, or read and fitted), attaches it to the
request and hands the ticket on; a refusal ends that request alone. Loads run one at a time,
in order; the requests waiting for one count towards the engine's queue bound.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..errors import GenerationCancelled, NeoPPError, WorkerFailure
from .engine import Ticket, closed_error, is_cancelled

log = logging.getLogger(__name__)


class AdapterLoader:
    """One thread loading the adapters of accepted requests for one store."""

    def __init__(self, store: Callable[[], Any], then: Callable[[Ticket], None]) -> None:
        self._store, self._then = store, then
        self._queue: queue.Queue[Ticket | None] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="neopp-adapter-loader", daemon=True)
        self._thread.start()

    def submit(self, ticket: Ticket) -> None:
        """Load ``ticket``'s adapter, then hand it on (or end it with its refusal)."""
        with self._lock:
            if self._closed:
                ticket.end(closed_error())
                return
            self._queue.put(ticket)

    @property
    def waiting(self) -> int:
        """Requests waiting for their adapter."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop: requests still waiting for their adapter end with a cancellation."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (ticket := self._queue.get()) is not None:
            if self._closed:  # what waits behind a closing engine is not read
                ticket.end(closed_error())
            else:
                self._load(ticket)

    def _load(self, ticket: Ticket) -> None:
        if is_cancelled(ticket):
            ticket.end(GenerationCancelled("cancelled before it started"))
            return
        try:
            ticket.req.adapter = self._store().get(ticket.req.lora)
        except NeoPPError as exc:
            ticket.end(exc)
            return
        except Exception as exc:  # noqa: BLE001 - one adapter's failure ends its own request, never the loader
            log.exception("loading adapter %r failed", ticket.req.lora)
            ticket.end(WorkerFailure(f"LORA: adapter {ticket.req.lora!r} could not be loaded ({type(exc).__name__})"))
            return
        self._then(ticket)
