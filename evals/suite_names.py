"""The suite names, in default run order, without the suites' implementations.

Kept apart from ``evals.suites`` (which imports the model stack through ``evals.context``) so that
validating a recipe or building the CLI's parser does not import torch. ``evals.suites`` checks at
import time that its registry holds exactly these names in this order.
"""

from __future__ import annotations

SUITE_NAMES: tuple[str, ...] = ("task_accuracy", "sampled_task_accuracy", "format_adherence", "safety",
                                "perplexity", "preference_accuracy", "structured")


def suite_names() -> list[str]:
    return list(SUITE_NAMES)
