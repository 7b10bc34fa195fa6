"""sampled_task_accuracy: held-out tasks answered with sampling, as a client of our server gets them.

Why beside the greedy ``task_accuracy``: a request that names no temperature is sampled at 1.0 (the
OpenAI default our server keeps unless the model's generation_config.json sets another), so the accuracy
such a client sees is the share of *sampled* replies that are right, and it can sit well below greedy when
the model spreads mass over wrong answers. It is also the figure GRPO trains (its reward is the
correctness of sampled replies), so it shows what GRPO changed even when greedy accuracy is already near
its ceiling. ``task_pass_at_k`` (any of the k samples right) is the headroom: what sharpening alone could
reach.
"""

from __future__ import annotations

from evals.context import EvalContext
from evals.data import TASKS_FILE
from evals.results import EvalResult
from evals.scoring import is_correct
from evals.suites.base import Suite
from evals.suites.common import mean_result
from evals.suites.task_accuracy import task_records, task_slices

NAME = "sampled_task_accuracy"


def score_samples(records: list[dict], samples: list[list[str]]) -> list[EvalResult]:
    """Mean correctness over every sample (pass@1 estimated from k draws) and the share of prompts with
    at least one right sample (pass@k), both sliced by task and difficulty."""
    right = [[is_correct(text, r["answer"]) for text in texts] for r, texts in zip(records, samples, strict=True)]
    tasks = task_slices(records)
    return [
        mean_result(NAME, "sampled_task_accuracy", [sum(hits) / len(hits) for hits in right], tasks),
        mean_result(NAME, "task_pass_at_k", [float(any(hits)) for hits in right], tasks),
    ]


def run(ctx: EvalContext) -> list[EvalResult]:
    records = task_records(ctx)
    samples = ctx.sample([ctx.user_prompt(r["prompt"]) for r in records], desc="sampled tasks")
    return score_samples(records, [[g.text for g in gens] for gens in samples])


SUITE = Suite(NAME, (TASKS_FILE,), run,
              "held-out task prompts answered right by sampled replies (samples_per_prompt at sample_temperature)")
