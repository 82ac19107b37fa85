"""Error types that tell who is at fault, so the serving layer can map them to statuses."""


class NeoPPError(Exception):
    """Base of every error this package raises on purpose."""


class InputError(NeoPPError, ValueError):
    """The request is at fault (INVALID_ARG); the message names the input and the rule."""


class ConfigError(NeoPPError):
    """The deployment is at fault: checkpoint, mode file or model parameters."""


class GenerationCancelled(NeoPPError):
    """The caller asked to stop between two denoising steps."""
