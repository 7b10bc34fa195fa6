"""safety: refusal rate on harmful prompts (want high) and over-refusal on look-alikes (want low).

Refusals are detected with :data:`evals.scoring.REFUSAL_PATTERNS`. A category with no records in the
file yields no metric (a warning says so), so a gate on it fails as "missing" instead of passing on 0/0.

A record may name a finer category (``harm``: explosives, firearms, ...; or ``harm_category`` or
``subcategory``, as safety sets name it): each metric is then also reported per such category, its slices, which
the rollout's offline comparison judges one by one (``serving.rollout.offline``), so a model that stops refusing
one kind of harm cannot hide it in the average.
"""

from __future__ import annotations

import warnings

from evals.context import EvalContext
from evals.data import SAFETY_FILE
from evals.results import EvalResult
from evals.scoring import is_refusal
from evals.suites.base import Suite
from evals.suites.common import mean_result, slice_labels, stratum

SAFETY_FIELDS: dict[str, type | tuple[type, ...]] = {"id": str, "prompt": str, "category": str}
METRICS = {"harmful": "refusal_rate", "lookalike": "over_refusal_rate"}
SLICE_FIELDS = ("harm", "harm_category", "subcategory")  # a record's finer category, the first one it has


def score_safety(records: list[dict], replies: list[str], source: str = SAFETY_FILE) -> list[EvalResult]:
    """Refusal share per category, sliced by the records' finer category where they name one; records of other
    categories are ignored."""
    results = []
    for category, metric in METRICS.items():
        chosen = [(r, text) for r, text in zip(records, replies, strict=True) if r["category"] == category]
        if not chosen:
            warnings.warn(f"{source}: no {category!r} records; {metric} not measured", stacklevel=2)
            continue
        scores = [float(is_refusal(text)) for _, text in chosen]
        labels = slice_labels([stratum(r, *SLICE_FIELDS) for r, _ in chosen])
        results.append(mean_result("safety", metric, scores, labels))
    return results


def safety_records(ctx: EvalContext) -> list[dict]:
    records = ctx.records(SAFETY_FILE, SAFETY_FIELDS, stratify=lambda r: r["category"])
    return [r for r in records if r["category"] in METRICS]


def safety_prompts(ctx: EvalContext) -> list[str]:
    return [ctx.user_prompt(r["prompt"]) for r in safety_records(ctx)]


def run(ctx: EvalContext) -> list[EvalResult]:
    records = safety_records(ctx)
    replies = ctx.generate(safety_prompts(ctx), desc="safety")
    return score_safety(records, [g.text for g in replies], source=str(ctx.data_dir / SAFETY_FILE))


SUITE = Suite("safety", (SAFETY_FILE,), run,
              "refusal_rate on harmful prompts and over_refusal_rate on benign look-alikes", safety_prompts)
