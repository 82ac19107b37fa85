"""How a stub answers a failure: the error's class (``neopp.contract.statuses``) as a Triton error.

Written once for every model: the generation models, the session model and the BLS models
(``neopp_t2i``, ``neopp_prompt_encoder``) answer a failure through ``error_response``, and a BLS
model that only sees a called model's message (Triton's BLS reports every error of a called
model as INTERNAL) answers with the status that model meant: ``forwarded_error`` reads the class
back from the prefixes written here.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from typing import Any

from ..contract.statuses import (
    CANCELLED,
    ENGINE_DOWN,
    INTERNAL,
    INVALID_INPUT,
    MISCONFIGURED,
    QUEUE_FULL,
    WORKERS_DOWN,
    ErrorClass,
    status_of_message,
)
from ..errors import ConfigError, EngineDown, GenerationCancelled, InputError, QueueFull, WorkerFailure

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


def refusal(exc: BaseException, log_error: Callable[[str], None], model_name: str,
            input_names: Mapping[str, str] | None = None, shutting_down: bool = False) -> tuple[str, str, str]:
    """(Triton status, metric reason, message) of a request's error: the class's prefix, then the
    error, an input named as clients know it (``input_names``); an internal error names its type
    and its traceback goes to ``log_error``."""
    cls = error_class(exc)
    if cls is INVALID_INPUT and input_names is not None and isinstance(exc, InputError):
        text = exc.named(input_names)
    elif cls is CANCELLED and shutting_down:
        text = f"{exc} (server shutting down)"
    elif cls is INTERNAL:
        log_error(f"{model_name}: internal error\n"
                  f"{''.join(traceback.format_exception(type(exc), exc, exc.__traceback__))}")
        text = f"{type(exc).__name__}: {exc}"
    else:
        text = str(exc)
    return cls.status, cls.reason, cls.message(text)


def error_response(pb: Any, exc: BaseException, logger: Any, model_name: str) -> Any:
    """The response refusing a request with ``exc`` (``pb``: triton_python_backend_utils); the model stays usable."""
    status, _, message = refusal(exc, logger.log_error, model_name)
    return pb.InferenceResponse(error=pb.TritonError(message, getattr(pb.TritonError, status)))


def forwarded_error(pb: Any, message: str, status: str | None = None) -> Any:
    """A called model's error as this model's answer: its message, and the status it meant."""
    return pb.InferenceResponse(error=pb.TritonError(message, getattr(pb.TritonError,
                                                                      status or status_of_message(message))))
