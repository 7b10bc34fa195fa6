"""Errors the engine raises for requests it cannot take; the API maps each to an HTTP status."""

import re

from artifacts.errors import LifecycleError

_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


class EngineError(LifecycleError):
    """Base class of serving-engine errors meant for the caller."""


class InvalidRequestError(EngineError):
    """The request can never be served as asked (bad sampling value, prompt over the context): HTTP 400.

    Every message leads with the request field at fault (``"top_k: must be <= ..."``); ``param`` is that
    field, so the API can name it in OpenAI's error body. Derived from the message rather than stored, so
    the error stays the one-argument exception that crosses the engine-core process pipe unchanged."""

    @property
    def param(self) -> str | None:
        field, colon, _ = str(self).partition(":")
        return field if colon and _FIELD.fullmatch(field) else None


class UnknownAdapterError(EngineError):
    """The request names a LoRA adapter this engine has not loaded (HTTP 404, ``model_not_found``)."""


class LoraError(EngineError):
    """An adapter that cannot be served on this base (HTTP 400): the message names the file and the reason."""


class QueueFullError(EngineError):
    """The waiting queue is at ``max_queue``; retry later (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDrainingError(EngineError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


class ModelLoadError(EngineError):
    """The model directory cannot be loaded (missing files, unsupported architecture)."""
