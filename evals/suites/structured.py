"""structured: the held-out tasks asked for a JSON answer, with and without the grammar.

Three numbers, because a program that calls the model cares about each: ``json_schema_adherence``, how often the
model's own greedy reply is JSON valid for the task's schema (what a client gets without ``response_format``);
``constrained_validity``, how often a reply under the server's grammar finished and is valid (the promise
``response_format`` makes: the grammar, not the model, keeps it, so anything under 1.0 is a broken promise, a reply
cut by ``max_new_tokens`` included); and ``constrained_task_accuracy``, how often that valid reply holds the right
answer (what the model still knows when its reply is forced into another format).
"""

from __future__ import annotations

from evals.context import EvalContext
from evals.data import TASKS_FILE, take_stratified
from evals.generation import Generation
from evals.json_replies import (
    answer_schema,
    json_answer_correct,
    json_reply_problem,
    json_task_prompt,
    reply_token_bound,
)
from evals.results import EvalResult
from evals.suites.base import Suite
from evals.suites.common import mean_result
from evals.suites.task_accuracy import task_records, task_slices


def structured_records(ctx: EvalContext) -> list[dict]:
    """``structured_examples`` of the held-out tasks, drawn round-robin across tasks so every task keeps some."""
    return take_stratified(task_records(ctx), ctx.config.structured_examples, lambda r: r["task"])


def structured_prompts(ctx: EvalContext) -> list[str]:
    return [ctx.user_prompt(json_task_prompt(r["prompt"], r["answer"])) for r in structured_records(ctx)]


def score_structured(records: list[dict], free: list[Generation], constrained: list[Generation]) -> list[EvalResult]:
    schemas = [answer_schema(r["answer"]) for r in records]
    adherent = [float(json_reply_problem(g.text, s) is None) for g, s in zip(free, schemas, strict=True)]
    valid = [float(g.stopped_on_eos and json_reply_problem(g.text, s) is None)
             for g, s in zip(constrained, schemas, strict=True)]
    correct = [float(ok and json_answer_correct(g.text, r["answer"]))
               for ok, g, r in zip(valid, constrained, records, strict=True)]
    slices = task_slices(records)
    return [mean_result("structured", "json_schema_adherence", adherent, slices),
            mean_result("structured", "constrained_validity", valid, slices),
            mean_result("structured", "constrained_task_accuracy", correct, slices)]


def run(ctx: EvalContext) -> list[EvalResult]:
    records = structured_records(ctx)
    prompts = structured_prompts(ctx)
    # room for the longest reply the schemas allow: the work lines make a JSON reply longer than a plain one
    room = max((reply_token_bound(r["answer"]) for r in records), default=0)
    free = ctx.generate(prompts, desc="json", min_new_tokens=room)
    constrained = ctx.generate_constrained(prompts, [answer_schema(r["answer"]) for r in records], desc="json schema",
                                           min_new_tokens=room)
    return score_structured(records, free, constrained)


# no prompts for the runner's shared greedy pass: that pass stops at max_new_tokens, and a JSON reply with its
# work lines is longer than a plain one, so the suite generates its own with room for the longest valid reply
SUITE = Suite("structured", (TASKS_FILE,), run,
              "held-out tasks asked for JSON: schema adherence unconstrained; validity and accuracy under the grammar")
