"""Gates: thresholds on eval metrics that a model must meet to be promoted.

A gate names a key of the flat metrics dict (``task_accuracy``, ``task_accuracy/addition``,
``over_refusal_rate``...). A metric that was not measured fails its gate with a reason instead of
raising, because "we did not measure it" must never read as "it passed".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from evals.results import EvalResult, metrics_dict

OPS = (">=", "<=")
_GATE_RE = re.compile(r"^\s*([^\s<>=]+)\s*(>=|<=)\s*(\S+)\s*$")


@dataclass
class Gate:
    metric: str
    op: str  # ">=" or "<="
    threshold: float

    def __post_init__(self) -> None:
        if not self.metric:
            raise ValueError("metric: must be a non-empty metric name")
        if self.op not in OPS:
            raise ValueError(f"op: must be one of {', '.join(OPS)}, got {self.op!r}")
        if not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool) \
                or math.isnan(self.threshold):
            raise ValueError(f"threshold: must be a number, got {self.threshold!r}")
        self.threshold = float(self.threshold)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g}"


def parse_gate(text: str) -> Gate:
    """``"task_accuracy >= 0.3"`` → Gate (lets a YAML recipe list gates as plain strings)."""
    match = _GATE_RE.match(text)
    if not match:
        raise ValueError(f"gates: cannot parse {text!r}; expected '<metric> >= <number>' or '<= <number>'")
    metric, op, number = match.groups()
    try:
        threshold = float(number)
    except ValueError:
        raise ValueError(f"gates: threshold in {text!r} is not a number") from None
    return Gate(metric=metric, op=op, threshold=threshold)


@dataclass
class GateCheck:
    """One gate's outcome; ``measured`` is None when the metric was not in the results."""

    gate: Gate
    measured: float | None
    passed: bool
    reason: str


@dataclass
class GateReport:
    checks: list[GateCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[GateCheck]:
        return [c for c in self.checks if not c.passed]

    def summary(self) -> str:
        if self.passed:
            return f"all {len(self.checks)} gates passed"
        return "gates failed: " + "; ".join(c.reason for c in self.failures)


def _check(gate: Gate, metrics: dict[str, float]) -> GateCheck:
    if gate.metric not in metrics:
        return GateCheck(gate, None, False, f"{gate.metric}: not measured (gate {gate})")
    value = metrics[gate.metric]
    if math.isnan(value):
        return GateCheck(gate, value, False, f"{gate.metric}: measured nan (gate {gate})")
    ok = value >= gate.threshold if gate.op == ">=" else value <= gate.threshold
    verdict = "ok" if ok else "fails"
    reason = f"{gate.metric}: measured {value:.4g} {verdict} {gate.op} {gate.threshold:g}"
    return GateCheck(gate, value, ok, reason)


def check_gates(results: list[EvalResult], gates: list[Gate]) -> GateReport:
    """Evaluate every gate against the results' flat metrics (slices included)."""
    metrics = metrics_dict(results)
    return GateReport(checks=[_check(g, metrics) for g in gates])


def failed_gates(gates: list[Gate], metrics: dict[str, float]) -> list[Gate]:
    """The gates ``metrics`` (one model's flat metrics) fail, a missing metric included."""
    return [g for g in gates if not _check(g, metrics).passed]
