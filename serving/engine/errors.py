"""Errors the engine raises for requests it cannot take; the API maps each to an HTTP status."""

from artifacts.errors import LifecycleError


class EngineError(LifecycleError):
    """Base class of serving-engine errors meant for the caller."""


class InvalidRequestError(EngineError):
    """The request can never be served as asked (bad sampling value, prompt over the context): HTTP 400."""


class QueueFullError(EngineError):
    """The waiting queue is at ``max_queue``; retry later (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDrainingError(EngineError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


class ModelLoadError(EngineError):
    """The model directory cannot be loaded (missing files, unsupported architecture)."""
