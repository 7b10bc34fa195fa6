"""Errors the quantize stage raises for the user (the CLI prints them as one line)."""

from artifacts.errors import LifecycleError


class QuantizeError(LifecycleError):
    """The model, the data or the recipe cannot be quantized as asked; the message says why."""


class QuantizeGateError(QuantizeError):
    """A quality gate failed (e.g. GPTQ did not beat round-to-nearest on KL); names the measured values."""
