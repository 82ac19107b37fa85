"""How each error class reaches a client: metric reason, Triton status and message prefix.

Written once because the session model only sees a called model's message (Triton's BLS
reports every error of a called model as INTERNAL) and must answer with the status that model
meant: it reads the class back from the prefixes written here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError, GenerationCancelled, InputError, QueueFull, WorkerFailure


@dataclass(frozen=True)
class ErrorClass:
    reason: str  # the failure metric's label
    status: str  # attribute of pb_utils.TritonError
    prefix: str  # how the message starts ("" for input errors: they start with the input's name)

    def message(self, text: str) -> str:
        return f"{self.prefix}: {text}" if self.prefix else text


INVALID_INPUT = ErrorClass("invalid_input", "INVALID_ARG", "")
CANCELLED = ErrorClass("cancelled", "CANCELLED", "request cancelled")
WORKERS_DOWN = ErrorClass("worker_failure", "UNAVAILABLE", "rank workers unavailable")
# Worded as Triton's own full queue, so every client (and the HTTP door: 429) reads it the same way.
QUEUE_FULL = ErrorClass("queue_full", "UNAVAILABLE", "")
MISCONFIGURED = ErrorClass("config", "INTERNAL", "model configuration error")
INTERNAL = ErrorClass("internal", "INTERNAL", "internal error")
NOT_FOUND = ErrorClass("not_found", "NOT_FOUND", "")

_INPUT_NAMED = re.compile(r"^[A-Z][A-Z0-9_/]*: ")  # "COND_KV: ...": an input error of our models
_CORE_INPUT_ERRORS = ("for input '", "unexpected inference input", "expected input", "inference input")


def error_class(exc: BaseException) -> ErrorClass:
    """The class of an exception raised while serving one request."""
    if isinstance(exc, InputError):
        return INVALID_INPUT
    if isinstance(exc, GenerationCancelled):
        return CANCELLED
    if isinstance(exc, WorkerFailure):
        return WORKERS_DOWN
    if isinstance(exc, QueueFull):
        return QUEUE_FULL
    if isinstance(exc, ConfigError):
        return MISCONFIGURED
    return INTERNAL


def status_of_message(message: str) -> str:
    """The status a generation model (or Triton itself) sent with ``message``."""
    text = re.sub(r"^\[request id: [^\]]*\] ", "", message.strip())
    for cls in (CANCELLED, WORKERS_DOWN, MISCONFIGURED, INTERNAL):
        if text.startswith(cls.prefix):
            return cls.status
    if "unknown model" in text or " is not found" in text:
        return NOT_FOUND.status
    if "is not ready" in text or text.startswith("Exceeds maximum queue size"):
        return WORKERS_DOWN.status
    if _INPUT_NAMED.match(text) or any(part in text for part in _CORE_INPUT_ERRORS):
        return INVALID_INPUT.status
    return INTERNAL.status
