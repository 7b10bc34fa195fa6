"""What a rollout does when only its 5xx or 429 rate is short of evidence: move on, or wait for more requests.

A rate gate with a design increase (Gates.detect_*) passes only on enough requests to have failed that increase
with the design power (judge.rate_gate). The canary's rates pool over its steps, so a rate within its tolerance
that simply lacks requests need not hold an early step: the next, larger weight brings them sooner, and the last
step, which decides promotion, still has to pass it. A rate above its tolerance but not significantly so, or a
short rate at the last step, holds the step instead, by a *rate extension* sized to the requests it lacks at the
traffic seen so far (Kayenta and Argo extend by a fixed window; a sample-size-driven one ends as soon as the
evidence can be there, and says how long that is). Each rate extension is a look, counted in the alpha budget
(RolloutPlan.most_looks); once they are spent, the ordinary extension and pause take over.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.rollout import analysis as A
from serving.rollout.analysis import Analysis
from serving.rollout.plan import RolloutPlan
from serving.rollout.state import CANARY, SHADOW, RolloutState


@dataclass(frozen=True)
class RateDecision:
    cause: str  # what the decision log says
    extend_seconds: float | None  # None: advance to the next phase; else extend this one by that long


def next_for_rate_evidence(state: RolloutState, plan: RolloutPlan, result: Analysis,
                           phase_seconds: float) -> RateDecision | None:
    """The decision for an inconclusive ``result`` whose every inconclusive verdict is a rate gate that more
    requests would settle; None when anything else is inconclusive, or the rate extensions are spent."""
    waiting = result.inconclusive()
    if not waiting or not all(A.collecting_rate_evidence(v) for v in waiting):
        return None
    last = state.phase == CANARY and state.step_index == len(plan.steps) - 1
    if not last and all(A.rate_within_tolerance(v, plan.gates) for v in waiting):
        gates = ", ".join(f"{v.gate} ~{v.more_samples} more candidate requests" for v in waiting)
        return RateDecision(f"analysis {result.look} passed but for rates within their tolerance still short of "
                            f"requests, collected on at the next phase (the canary pools its steps): {gates}", None)
    if state.rate_extensions >= plan.max_rate_extensions:
        return None
    more = max(v.more_samples or 0 for v in waiting)
    seconds = seconds_for(more, result, "shadow" if state.phase == SHADOW else "canary", phase_seconds)
    return RateDecision(f"collecting rate evidence, {seconds:.0f} s more ({state.rate_extensions + 1}/"
                        f"{plan.max_rate_extensions}): {result.reasons}", seconds)


def seconds_for(more: int, result: Analysis, candidate_variant: str, phase_seconds: float) -> float:
    """How long the candidate's side takes to bring ``more`` requests at the rate seen in ``result``'s window
    (a tenth to spare), kept between a tenth of the phase and twice it."""
    seen = sum(row["requests"] for row in result.traffic if row["variant"] == candidate_variant)
    elapsed = max(result.until - result.since, 1e-9)
    needed = 1.1 * more * elapsed / seen if seen else 2 * phase_seconds
    return min(max(needed, phase_seconds / 10), 2 * phase_seconds)
