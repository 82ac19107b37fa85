"""A daemon thread that runs one check every few seconds until stopped: what the launcher's
watchers (the stub watchdog, the stuck-load rescue) share."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Poller:
    """Calls ``check`` every ``interval_s`` seconds; an exception is handed to ``on_error`` (the
    server may be busy or stopping) and the next round runs anyway."""

    def __init__(self, name: str, interval_s: float, check: Callable[[], object],
                 on_error: Callable[[Exception], None]) -> None:
        self.name, self.interval_s, self.check, self.on_error = name, interval_s, check, on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - one failed round must not end the watch
                self.on_error(exc)
