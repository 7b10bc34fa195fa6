"""The candidate's offline eval record against the champion's: metric by metric, and slice by slice.

The release stage stores each version's eval results beside it in MLflow, with sample counts and the suites'
slices (task type and difficulty, safety category). The held-out sets are larger than any probe budget, so a
regression too small for the probes to prove is often clear here; both records were measured by the same suites
on the same held-out data, or the comparison is skipped (a metric only one side has).

Two comparisons the averages alone would miss:

- **Sampled accuracy.** A request that names no temperature is sampled at the server's default (1.0), so the
  accuracy such a client sees is the share of *sampled* replies that are right. A model can keep its greedy
  answers and lose its sampled ones (the calibration's "lost task accuracy" candidate: greedy 0.93 vs 0.99,
  sampled 0.55 vs 0.75). The record's value is the mean over prompts of each prompt's share of right samples,
  and ``n`` counts prompts: judging it as n Bernoulli trials is conservative, since a per-prompt mean of k
  draws varies no more than one draw at the same mean.
- **Slices.** A regression confined to one task type or one harm category moves the average little. Each
  metric's slices (those with ``OFFLINE_MIN_SAMPLES`` on both sides) are tested at ``alpha`` divided by their
  number (Bonferroni within the metric), and reported as one verdict per metric, ``<gate>_slices``: fail naming
  the slices proven worse, else pass, naming any slice worse than the tolerance but not significantly so. Why
  such a slice does not hold the rollout: the record is fixed, so no window can settle it, and a slice of 20-40
  prompts can prove only +0.3-0.4 at its share of alpha, so "beyond the tolerance, not proven" is the ordinary
  state of a small slice of a candidate that differs in a few answers (the pipeline's 4-bit candidate read +0.087
  on 23 prompts and paused its first rollout); the metric's own verdict over every prompt keeps the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serving.rollout import judge
from serving.rollout.judge import FAIL, INCONCLUSIVE, PASS, Verdict
from serving.rollout.plan import Gates


@dataclass(frozen=True)
class OfflineMetric:
    gate: str
    tolerance: str  # the field of Gates
    higher_is_better: bool
    label: str  # what a bad outcome is called


OFFLINE_METRICS = {
    "task_accuracy": OfflineMetric("offline_accuracy", "max_accuracy_drop", True, "wrong answers"),
    "sampled_task_accuracy": OfflineMetric("offline_sampled_accuracy", "max_accuracy_drop", True,
                                           "wrong sampled answers"),
    "refusal_rate": OfflineMetric("offline_refusal", "max_refusal_drop", True, "harmful answered"),
    "over_refusal_rate": OfflineMetric("offline_over_refusal", "max_over_refusal_increase", False, "benign refused"),
    "format_adherence": OfflineMetric("offline_format", "max_format_drop", True, "broken format"),
    "constrained_validity": OfflineMetric("offline_structured", "max_format_drop", True, "invalid JSON"),
    "constrained_task_accuracy": OfflineMetric("offline_structured_accuracy", "max_accuracy_drop", True,
                                               "wrong structured answers"),
}
OFFLINE_MIN_SAMPLES = 20
SLICES_SUFFIX = "_slices"


@dataclass
class Measured:
    value: float
    n: int
    slices: dict[str, tuple[float, int]] = field(default_factory=dict)


def offline_gates() -> set[str]:
    """Every gate name the offline comparison can give (what a waiver may name)."""
    return {name for m in OFFLINE_METRICS.values() for name in (m.gate, m.gate + SLICES_SUFFIX)}


def _measured(record: dict[str, Any] | None) -> dict[str, Measured]:
    """metric -> what the record measured (records written before they carried results have none: those
    versions are compared by probes only)."""
    out = {}
    for row in (record or {}).get("results") or []:
        if isinstance(row, dict) and row.get("metric") in OFFLINE_METRICS and int(row.get("n") or 0) > 0:
            slices = {str(label): (float(s["value"]), int(s["n"])) for label, s in (row.get("slices") or {}).items()
                      if isinstance(s, dict) and int(s.get("n") or 0) > 0}
            out[row["metric"]] = Measured(float(row["value"]), int(row["n"]), slices)
    return out


def _rate_verdict(gate: str, metric: OfflineMetric, candidate: tuple[float, int], champion: tuple[float, int],
                  gates: Gates, alpha: float, label: str) -> Verdict:
    (value_c, n_c), (value_b, n_b) = candidate, champion
    bad_c = round(n_c * (1 - value_c if metric.higher_is_better else value_c))
    bad_b = round(n_b * (1 - value_b if metric.higher_is_better else value_b))
    return judge.rate_gate(gate, bad_c, n_c, bad_b, n_b, margin=getattr(gates, metric.tolerance), alpha=alpha,
                           min_samples=OFFLINE_MIN_SAMPLES, label=label)


def _slices_verdict(metric: OfflineMetric, candidate: Measured, champion: Measured, gates: Gates,
                    alpha: float) -> Verdict | None:
    common = sorted(label for label, (_, n) in candidate.slices.items()
                    if label in champion.slices and min(n, champion.slices[label][1]) >= OFFLINE_MIN_SAMPLES)
    if not common:
        return None
    per_slice = alpha / len(common)
    each = [_rate_verdict(f"{metric.gate}/{label}", metric, candidate.slices[label], champion.slices[label], gates,
                          per_slice, f"{metric.label} in {label}") for label in common]
    failed = [v for v in each if v.outcome == FAIL]
    doubtful = [v for v in each if v.outcome == INCONCLUSIVE]
    worst = max(each, key=lambda v: v.candidate - v.baseline)
    outcome = FAIL if failed else PASS
    head = f"{len(common)} slices, each at α/{len(common)}: "
    if failed:
        reason = head + "; ".join(v.reason for v in failed)
    elif doubtful:
        reason = head + "none proven worse; " + "; ".join(v.reason for v in doubtful)
    else:
        reason = head + f"all within {getattr(gates, metric.tolerance):g} (worst: {worst.reason})"
    return Verdict(metric.gate + SLICES_SUFFIX, outcome, worst.candidate, worst.baseline, worst.threshold,
                   min((v.p_value for v in each if v.p_value is not None), default=None), min(v.samples for v in each),
                   OFFLINE_MIN_SAMPLES, reason)


def offline_verdicts(candidate: dict[str, Any] | None, champion: dict[str, Any] | None, gates: Gates,
                     alpha: float) -> list[Verdict]:
    """The candidate's offline record against the champion's: a rate test per metric (the probes' test), then
    one verdict per metric over its slices."""
    cand, champ = _measured(candidate), _measured(champion)
    out = []
    for name, metric in OFFLINE_METRICS.items():
        if name not in cand or name not in champ:
            continue
        out.append(_rate_verdict(metric.gate, metric, (cand[name].value, cand[name].n),
                                 (champ[name].value, champ[name].n), gates, alpha, f"{metric.label} (offline)"))
        slices = _slices_verdict(metric, cand[name], champ[name], gates, alpha)
        if slices is not None:
            out.append(slices)
    return out
