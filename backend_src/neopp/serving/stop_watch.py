"""Notice, from inside a model, that Triton has begun to stop.

At shutdown Triton waits until no model has an inference in flight, and an open sequence (a
session that was never ended) counts as in flight until its idle bound, far longer than the
exit timeout. Nothing tells a Python model that this wait has begun, and asking through the
stub (``is_model_ready``) may hang once it has. The server's own gRPC port does tell: from
the first moment of a stop its readiness check answers UNAVAILABLE "Server exiting", while
it still takes the requests that end sequences. ``StopWatch`` polls that and calls
``on_stop`` once, so the model can end what it holds and let the server exit cleanly.

Only that exact answer counts: a slow or refused check (a busy machine, a server still
loading) is never taken for a stop, because ending every session of a running server would
be worse than a slow shutdown.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def server_exiting(client: Any, timeout_s: float = 5.0) -> bool:
    """True only when a tritonclient.grpc client's server says it is exiting."""
    try:
        client.is_server_ready(client_timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - InferenceServerException, or a transport error
        status = exc.status() if hasattr(exc, "status") else None
        message = exc.message() if hasattr(exc, "message") else str(exc)
        return "UNAVAILABLE" in str(status) and "exiting" in str(message).lower()
    return False


class StopWatch:
    """Calls ``on_stop`` once, from its own thread, the first time ``is_stopping()`` is true."""

    def __init__(self, is_stopping: Callable[[], bool], on_stop: Callable[[], None], poll_s: float = 0.5,
                 name: str = "neopp-stop-watch") -> None:
        self._is_stopping, self._on_stop, self._poll_s = is_stopping, on_stop, float(poll_s)
        self._closed = threading.Event()
        self.stopped = threading.Event()  # set once the stop was seen
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._closed.wait(self._poll_s):
            try:
                stopping = self._is_stopping()
            except Exception:  # noqa: BLE001 - a probe that fails says nothing about a stop
                stopping = False
            if stopping:
                self.stopped.set()
                self._on_stop()
                return
