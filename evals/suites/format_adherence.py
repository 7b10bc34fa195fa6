"""format_adherence: the reply ends on one ``Answer: ...`` line (after optional work lines) and stopped on eos."""

from __future__ import annotations

from evals.context import EvalContext
from evals.data import TASKS_FILE
from evals.generation import Generation
from evals.results import EvalResult
from evals.scoring import is_format_adherent
from evals.suites.base import Suite
from evals.suites.common import mean_result
from evals.suites.task_accuracy import task_generations, task_prompts


def score_format(records: list[dict], replies: list[Generation]) -> EvalResult:
    """Share of replies in the contract's answer format; a special token inside the reply breaks it."""
    scores = [float(g.n_special == 0 and is_format_adherent(g.raw, g.stopped_on_eos)) for g in replies]
    return mean_result("format_adherence", "format_adherence", scores, [r["task"] for r in records])


def run(ctx: EvalContext) -> list[EvalResult]:
    records, replies = task_generations(ctx)
    return [score_format(records, replies)]


SUITE = Suite("format_adherence", (TASKS_FILE,), run,
              "fraction of task replies ending on one 'Answer: ...' line and an eos token", task_prompts)
