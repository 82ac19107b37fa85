"""Error types that tell who is at fault, so the serving layer can map them to statuses."""

from __future__ import annotations

from collections.abc import Mapping


class NeoPPError(Exception):
    """Base of every error this package raises on purpose."""


class InputError(NeoPPError, ValueError):
    """The request is at fault (INVALID_ARG); the message is ``"<field>: <rule>"``.

    The core names a request field (``infer_steps``, ``cond_kv``); a caller that knows the field
    by another name (a Triton input, ``STEPS``) spells it its own way with :meth:`named`.
    """

    @property
    def field(self) -> str:
        return str(self).split(":", 1)[0]

    def named(self, names: Mapping[str, str]) -> str:
        """The message with its field spelled as ``names`` says (unknown fields stay as they are)."""
        text = str(self)
        field = self.field
        return names[field] + text[len(field):] if field in names else text


class ConfigError(NeoPPError):
    """The deployment is at fault: checkpoint, mode file or model parameters."""


class GenerationCancelled(NeoPPError):
    """The caller asked to stop between two denoising steps."""


class WorkerFailure(NeoPPError):
    """A rank died, a collective failed or timed out; the pool is being rebuilt."""


class EngineDown(NeoPPError):
    """The engine's loop stopped; what it held ends with this, the model is replaced: retry."""


class QueueFull(NeoPPError):
    """The engine already holds as many waiting requests as it may; the client retries later."""


class NonFiniteState(InputError):
    """The denoising state stopped being finite (inf or NaN).

    The weights are checked at load and every input is finite, so only request values far
    outside what the model was trained on (a KV prefix of huge magnitude, say) get here. The
    same request fails the same way every time, so it is the request's fault (INVALID_ARG),
    not a server fault worth retrying; the message names the step.
    """


SHOWN_CHARS = 40


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """A client value as it may appear in an error or a log line: its repr, cut to ``limit``.

    A request may carry megabytes in a string; echoed in full it floods the log and can make
    the error response itself too large to send.
    """
    if isinstance(value, (str, bytes, bytearray)):
        text = repr(value[:limit] if not isinstance(value, bytearray) else bytes(value[:limit]))
        unit = "characters" if isinstance(value, str) else "bytes"
        return text if len(value) <= limit else f"{text}... ({len(value)} {unit})"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
