"""The one exception the door turns into a response: status, message, optional headers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable


class DoorError(Exception):
    """A request the door answers itself; ``reason`` labels the refusal in the door's metrics."""

    def __init__(self, status: int, message: str, reason: str = "invalid",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason
        self.headers = headers or {}
        self.after: Callable[[], Awaitable[None]] | None = None  # run once the answer is sent

    def __reduce__(self):
        """Raised in a parse worker, rebuilt in the door (``after`` never crosses)."""
        return type(self), (self.status, self.message, self.reason, self.headers)


def invalid(message: str) -> DoorError:
    return DoorError(400, message)
