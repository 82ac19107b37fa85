"""How each error class reaches a client: metric reason, Triton status and message prefix.

Written once for every model: the generation models, the session model and the BLS models
(``neopp_t2i``, ``neopp_prompt_encoder``) answer a failure through ``error_response``, and a BLS
model that only sees a called model's message (Triton's BLS reports every error of a called
model as INTERNAL) answers with the status that model meant: ``forwarded_error`` reads the class
back from the prefixes written here.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, EngineDown, GenerationCancelled, InputError, QueueFull, WorkerFailure


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
QUEUE_FULL = ErrorClass("queue_full", "UNAVAILABLE", "")
MISCONFIGURED = ErrorClass("config", "INTERNAL", "model configuration error")
INTERNAL = ErrorClass("internal", "INTERNAL", "internal error")
NOT_FOUND = ErrorClass("not_found", "NOT_FOUND", "")
# Every session of neopp_session is in use: try again later (the HTTP door answers 429 with Retry-After).
SESSIONS_FULL = ErrorClass("sessions_full", "UNAVAILABLE", "session limit reached")

_INPUT_NAMED = re.compile(r"^[A-Z][A-Z0-9_/]*: ")  # "COND_KV: ...": an input error of our models
_CORE_INPUT_ERRORS = ("for input '", "unexpected inference input", "expected input", "inference input")


# the package's own errors, each with the class it is answered with
_CLASS_OF_ERROR: tuple[tuple[type[Exception], ErrorClass], ...] = (
    (InputError, INVALID_INPUT), (GenerationCancelled, CANCELLED), (WorkerFailure, WORKERS_DOWN),
    (EngineDown, ENGINE_DOWN), (QueueFull, QUEUE_FULL), (ConfigError, MISCONFIGURED))


def error_class(exc: BaseException) -> ErrorClass:
    """The class of an exception raised while serving one request (one that names its own class,
    ``error_class``, keeps it)."""
    declared = getattr(exc, "error_class", None)
    if isinstance(declared, ErrorClass):
        return declared
    for kind, cls in _CLASS_OF_ERROR:
        if isinstance(exc, kind):
            return cls
    return INTERNAL


# a called model whose stub died, or whose engine went away or does not answer (the engine link's words)
_GONE = re.compile(r"^Stub process '[\w.-]+' is not healthy\.?$|the engine of [\w.-]+ went away|"
                   r"on the engine of [\w.-]+, which does not answer")


def status_of_message(message: str) -> str:
    """The status a generation model (or Triton itself) sent with ``message``."""
    text = re.sub(r"^\[request id: [^\]]*\] ", "", message.strip())
    for cls in (CANCELLED, WORKERS_DOWN, ENGINE_DOWN, MISCONFIGURED, INTERNAL, SESSIONS_FULL):
        if text.startswith(cls.prefix):
            return cls.status
    if "unknown model" in text or " is not found" in text or ": unknown session" in text:
        return NOT_FOUND.status
    if "is not ready" in text or text.startswith("Exceeds maximum queue size"):
        return WORKERS_DOWN.status
    if _INPUT_NAMED.match(text) or any(part in text for part in _CORE_INPUT_ERRORS):
        return INVALID_INPUT.status
    if _GONE.search(text):  # after the input rules: a client's input name may carry these words
        return WORKERS_DOWN.status  # a retry is answered once the model is back
    return INTERNAL.status


def refusal_text(exc: BaseException, cls: ErrorClass) -> str:
    """What the client reads: the class's prefix, then the error (an internal one names its type)."""
    return cls.message(f"{type(exc).__name__}: {exc}" if cls is INTERNAL else str(exc))


def error_response(pb: Any, exc: BaseException, logger: Any, model_name: str) -> Any:
    """The response refusing a request with ``exc`` (``pb``: triton_python_backend_utils); an
    internal error's traceback goes to the log, the model stays usable."""
    cls = error_class(exc)
    if cls is INTERNAL:
        logger.log_error(f"{model_name}: internal error\n{traceback.format_exc()}")
    return pb.InferenceResponse(error=pb.TritonError(refusal_text(exc, cls), getattr(pb.TritonError, cls.status)))


def forwarded_error(pb: Any, message: str, status: str | None = None) -> Any:
    """A called model's error as this model's answer: its message, and the status it meant."""
    return pb.InferenceResponse(error=pb.TritonError(message, getattr(pb.TritonError,
                                                                      status or status_of_message(message))))
