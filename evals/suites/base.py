"""The suite record: a name, the data files it reads, and the function that scores a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from evals.context import EvalContext
from evals.results import EvalResult


@dataclass(frozen=True)
class Suite:
    name: str
    files: tuple[str, ...]  # data files (relative to the data dir) the suite reads; checked before loading
    run: Callable[[EvalContext], list[EvalResult]]
    description: str
    # The templated prompts the suite will generate replies for, so the runner can generate every
    # suite's prompts in one sorted, fully packed pass before the suites score them.
    prompts: Callable[[EvalContext], list[str]] | None = None
