"""task_accuracy: greedy replies to held-out verifiable tasks, answer parsed from ``Answer: X``."""

from __future__ import annotations

from evals.context import EvalContext
from evals.data import TASKS_FILE
from evals.generation import Generation
from evals.results import EvalResult
from evals.scoring import difficulty_slices, is_correct
from evals.suites.base import Suite
from evals.suites.common import mean_result

TASK_FIELDS: dict[str, type | tuple[type, ...]] = {"id": str, "task": str, "prompt": str, "answer": str}


def task_records(ctx: EvalContext) -> list[dict]:
    return ctx.records(TASKS_FILE, TASK_FIELDS, stratify=lambda r: r["task"])


def task_slices(records: list[dict]) -> list[tuple[str, ...]]:
    """Each record's slices: its task, and for a sum its width and carries (``evals.scoring``)."""
    return [difficulty_slices(r["task"], r["prompt"]) for r in records]


def task_prompts(ctx: EvalContext) -> list[str]:
    return [ctx.user_prompt(r["prompt"]) for r in task_records(ctx)]


def task_generations(ctx: EvalContext) -> tuple[list[dict], list[Generation]]:
    """The held-out task records and the model's greedy replies (shared with format_adherence)."""
    return task_records(ctx), ctx.generate(task_prompts(ctx), desc="tasks")


def score_tasks(records: list[dict], replies: list[str]) -> EvalResult:
    """Accuracy of ``replies`` against the records' reference answers, sliced by task and difficulty."""
    scores = [float(is_correct(text, r["answer"])) for r, text in zip(records, replies, strict=True)]
    return mean_result("task_accuracy", "task_accuracy", scores, task_slices(records))


def run(ctx: EvalContext) -> list[EvalResult]:
    records, replies = task_generations(ctx)
    return [score_tasks(records, [g.text for g in replies])]


SUITE = Suite("task_accuracy", (TASKS_FILE,), run,
              "fraction of held-out task prompts answered right (greedy, chat template)", task_prompts)
