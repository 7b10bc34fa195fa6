"""Typed eval results and the three views of them the pipeline needs: a flat metrics dict (MLflow, gates),
a markdown table (people, Prefect artifacts) and JSON (the eval record written beside a bundle).

Why one flat namespace: gates and dashboards address a number by a single key, so a slice of a metric
is ``"<metric>/<slice>"`` (``task_accuracy/addition``) and metric names are unique across suites.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from artifacts.common.atomic import atomic_write_text
from evals.errors import EvalError


@dataclass
class SliceResult:
    """The metric restricted to one stratum (a task, a category); ``n`` is the examples (or tokens) in it."""

    value: float
    n: int


@dataclass
class EvalResult:
    """One metric of one suite over one data file, with optional per-stratum slices."""

    suite: str
    metric: str
    value: float
    n: int
    slices: dict[str, SliceResult] = field(default_factory=dict)


def metrics_dict(results: list[EvalResult], prefix: str = "") -> dict[str, float]:
    """``{"task_accuracy": 0.4, "task_accuracy/addition": 0.5, ...}``, keys optionally prefixed."""
    out: dict[str, float] = {}
    for result in results:
        out[f"{prefix}{result.metric}"] = float(result.value)
        for name, sl in sorted(result.slices.items()):
            out[f"{prefix}{result.metric}/{name}"] = float(sl.value)
    return out


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if value != 0 and (abs(value) >= 1000 or abs(value) < 1e-3):
        return f"{value:.4g}"
    return f"{value:.4f}"


def markdown_table(results: list[EvalResult]) -> str:
    """A GitHub-markdown table: one row per metric, then one indented row per slice."""
    lines = ["| suite | metric | slice | value | n |", "|---|---|---|---:|---:|"]
    for r in results:
        lines.append(f"| {r.suite} | {r.metric} | (all) | {_fmt(r.value)} | {r.n} |")
        for name, sl in sorted(r.slices.items()):
            lines.append(f"| {r.suite} | {r.metric} | {name} | {_fmt(sl.value)} | {sl.n} |")
    return "\n".join(lines) + "\n"


def results_to_json(results: list[EvalResult]) -> str:
    return json.dumps({"results": [asdict(r) for r in results]}, indent=2, sort_keys=True) + "\n"


def results_from_json(text: str, source: str = "<string>") -> list[EvalResult]:
    """Inverse of :func:`results_to_json`; a malformed record raises EvalError naming ``source``."""
    try:
        raw = json.loads(text)
        return [
            EvalResult(
                suite=str(r["suite"]), metric=str(r["metric"]), value=float(r["value"]), n=int(r["n"]),
                slices={k: SliceResult(value=float(v["value"]), n=int(v["n"]))
                        for k, v in r.get("slices", {}).items()},
            )
            for r in raw["results"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise EvalError(f"{source}: not an eval results file ({type(exc).__name__}: {exc})") from exc


def write_results_json(results: list[EvalResult], path: str | Path) -> Path:
    return atomic_write_text(path, results_to_json(results))


def read_results_json(path: str | Path) -> list[EvalResult]:
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"{path}: eval results file not found")
    return results_from_json(path.read_text(encoding="utf-8"), source=str(path))


def to_jsonable(results: list[EvalResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
