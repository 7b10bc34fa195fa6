"""Errors the evals package raises for problems a user can fix (missing files, unusable models)."""

from artifacts.errors import LifecycleError


class EvalError(LifecycleError):
    """An eval cannot run: a model dir or data file is missing or malformed; the message names it."""
