"""User-facing error types: each carries a message meant to be shown as one line."""


class JaxllmError(Exception):
    """Base class for errors a user can cause and fix (bad path, bad checkpoint, bad flag)."""


class ModelLoadError(JaxllmError, ValueError):
    """A checkpoint cannot be loaded; the message names the file, tensor or field."""


class CompileGuardError(RuntimeError):
    """A step traced or compiled after warm-up: a bucket was missed or a shape leaked."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served until it is restarted."""
