"""One thread per streaming model that turns the engine's messages into responses.

Sending a response from the Python backend waits for the server process, and a preview is a
JPEG encode; done on the thread that reads the engine's messages, both would hold up every
other request's. That thread only queues its messages here; one thread keeps them in order and
delivers them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

HandleFn = Callable[[Any, Any], None]


class Delivery:
    """FIFO of (call, event) handled by ``handle`` on one thread; ``close`` delivers what is queued."""

    def __init__(self, handle: HandleFn) -> None:
        self._handle = handle
        self._items: queue.Queue[tuple[Any, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="neopp-stream-delivery", daemon=True)
        self._thread.start()

    def put(self, call: Any, event: Any) -> None:
        self._items.put((call, event))

    def close(self, timeout_s: float = 60.0) -> None:
        self._items.put(None)
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while (item := self._items.get()) is not None:
            try:
                self._handle(*item)
            except Exception:  # noqa: BLE001 - handle answers its own failures; one bad event never stops the rest
                pass
