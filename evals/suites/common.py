"""Small helpers the suites share to turn per-example scores into an EvalResult with slices."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from evals.results import EvalResult, SliceResult


def mean_result(suite: str, metric: str, scores: Sequence[float],
                strata: Sequence[str | Sequence[str]] | None = None) -> EvalResult:
    """Mean of ``scores``; with ``strata`` (one label, or a tuple of labels, per score) also the mean per
    label. A score with several labels counts in each of their slices (a sum is in its task's slice, its
    width's and its carries')."""
    slices: dict[str, SliceResult] = {}
    if strata is not None:
        groups: dict[str, list[float]] = defaultdict(list)
        for labels, score in zip(strata, scores, strict=True):
            for label in (labels,) if isinstance(labels, str) else labels:
                groups[label].append(score)
        slices = {label: SliceResult(value=sum(v) / len(v), n=len(v)) for label, v in groups.items()}
    value = sum(scores) / len(scores) if scores else float("nan")
    return EvalResult(suite=suite, metric=metric, value=value, n=len(scores), slices=slices)


def stratum(record: dict, *fields: str) -> str:
    """The first of ``fields`` the record has as a non-empty string, else ``""`` (no slice)."""
    for name in fields:
        value = record.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


def slice_labels(labels: list[str]) -> list[str] | None:
    """Slices only make sense when the records carry a label: all-unlabelled → no slices."""
    return [label or "unlabelled" for label in labels] if any(labels) else None
