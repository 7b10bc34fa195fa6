"""The suite registry: name → :class:`Suite`. Order here is the default run order."""

from __future__ import annotations

from evals.suite_names import SUITE_NAMES, suite_names
from evals.suites import (
    format_adherence,
    perplexity,
    preference,
    safety,
    sampled_task_accuracy,
    structured,
    task_accuracy,
)
from evals.suites.base import Suite

SUITES: dict[str, Suite] = {
    s.name: s
    for s in (task_accuracy.SUITE, sampled_task_accuracy.SUITE, format_adherence.SUITE, safety.SUITE,
              perplexity.SUITE, preference.SUITE, structured.SUITE)
}

if tuple(SUITES) != SUITE_NAMES:  # the light name list (read without torch) must match the registry
    raise RuntimeError(f"evals.suite_names.SUITE_NAMES {SUITE_NAMES} != registered suites {tuple(SUITES)}")


__all__ = ["SUITES", "Suite", "suite_names"]
