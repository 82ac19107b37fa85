"""Every error class a client can meet: its metric reason, its status and how its message starts.

A model answers a failure with its class's status (``status``: an attribute of Triton's
``TritonError``, carried as that code between the engine and its stub); the door turns a gRPC
status into its HTTP one (``HTTP_OF_GRPC``); a BLS model, which Triton hands every error of a
called model as INTERNAL, reads the class back from the message (``status_of_message``): the
prefixes written here are what it reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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
ENGINE_DOWN = ErrorClass("worker_failure", "UNAVAILABLE", "engine unavailable")
# Worded as Triton's own full queue, so every client (and the HTTP door: 429) reads it the same way.
QUEUE_FULL_TEXT = "Exceeds maximum queue size"
QUEUE_FULL = ErrorClass("queue_full", "UNAVAILABLE", "")
MISCONFIGURED = ErrorClass("config", "INTERNAL", "model configuration error")
INTERNAL = ErrorClass("internal", "INTERNAL", "internal error")
NOT_FOUND = ErrorClass("not_found", "NOT_FOUND", "")
# Every session of neopp_session is in use: try again later (the HTTP door answers 429 with Retry-After).
SESSIONS_FULL = ErrorClass("sessions_full", "UNAVAILABLE", "session limit reached")
# What the launcher's fronts cannot take now (a model being replaced, a client past its share, the
# bytes held): in a gRPC stream, where an error is text alone, this prefix tells the client to retry.
RETRY_LATER = ErrorClass("retry_later", "UNAVAILABLE", "not serving now, try again shortly")

_INPUT_NAMED = re.compile(r"^[A-Z][A-Z0-9_/]*: ")  # "COND_KV: ...": an input error of our models
_CORE_INPUT_ERRORS = ("for input '", "unexpected inference input", "expected input", "inference input")

# a called model whose stub died, or whose engine went away or does not answer (the engine link's words)
_GONE = re.compile(r"^Stub process '[\w.-]+' is not healthy\.?$|the engine of [\w.-]+ went away|"
                   r"on the engine of [\w.-]+, which does not answer")


def status_of_message(message: str) -> str:
    """The status a generation model (or Triton itself) sent with ``message``."""
    text = re.sub(r"^\[request id: [^\]]*\] ", "", message.strip())
    for cls in (CANCELLED, WORKERS_DOWN, ENGINE_DOWN, MISCONFIGURED, INTERNAL, SESSIONS_FULL, RETRY_LATER):
        if text.startswith(cls.prefix):
            return cls.status
    if "unknown model" in text or " is not found" in text or ": unknown session" in text:
        return NOT_FOUND.status
    if "is not ready" in text or text.startswith(QUEUE_FULL_TEXT):
        return WORKERS_DOWN.status
    if _INPUT_NAMED.match(text) or any(part in text for part in _CORE_INPUT_ERRORS):
        return INVALID_INPUT.status
    if _GONE.search(text):  # after the input rules: a client's input name may carry these words
        return WORKERS_DOWN.status  # a retry is answered once the model is back
    return INTERNAL.status


# gRPC status (its name) -> HTTP status, as Triton's HTTP endpoint answers for the same error;
# UNKNOWN is a request Triton could not take (400), anything else unlisted 500.
HTTP_OF_GRPC = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "UNAVAILABLE": 503,
                "UNIMPLEMENTED": 501, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403,
                "DEADLINE_EXCEEDED": 504, "CANCELLED": 499, "RESOURCE_EXHAUSTED": 429, "UNKNOWN": 400}
# "retry after N s": how a refusal that knows when to come back says so (Retry-After over HTTP)
RETRY_AFTER = re.compile(r"retry after (\d{1,6}) s")


def http_status(grpc_name: str) -> int:
    """The HTTP status of a gRPC status, by its name."""
    return HTTP_OF_GRPC.get(grpc_name, 500)


def is_full(message: str) -> str | None:
    """The reason a refusal is a full queue or session table (429 over HTTP), else None."""
    if QUEUE_FULL_TEXT in message:
        return QUEUE_FULL.reason
    if SESSIONS_FULL.prefix in message:
        return SESSIONS_FULL.reason
    return None
