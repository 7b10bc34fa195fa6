"""The suite record: a name, the data files it reads, and the function that scores a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from evals.context import EvalContext
from evals.results import EvalResult


@dataclass(frozen=True)
class Suite:
    name: str
    files: tuple[str, ...]  # data files (relative to the data dir) the suite reads; checked before loading
    run: Callable[[EvalContext], list[EvalResult]]
    description: str
