"""What a rollout does when all that holds a phase back is a gate short of evidence: move on, or wait for more.

The 5xx, 429, TTFT and ITL gates carry a design effect (Gates.detect_*: +3 points of 5xx, ×1.25 TTFT), and pass
only on enough requests to have failed it with the design power (judge.rate_gate, judge.shift_gate). Two ways
to get those requests:

- **move on**: before the last step, a rate within its tolerance, or a latency ratio below its design effect,
  is left to the next, larger weight (analysis.may_collect_at_next_step says why each may); the last step, which
  decides promotion, must pass it with power;
- **hold the step** with an *evidence extension*: a rate above its tolerance but not significantly, a latency
  ratio at or beyond its design effect but not significantly, or anything short of power at the last step. Its
  length is the time the traffic seen so far needs to bring the missing requests, with a tenth to spare
  (Kayenta and Argo extend by a fixed window; a sample-size-driven one ends as soon as the evidence can be
  there, and says how long that is).

Each evidence extension is a look, counted in the alpha budget (RolloutPlan.most_looks); once they are spent,
the ordinary extension and pause take over.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.rollout import analysis as A
from serving.rollout.analysis import Analysis
from serving.rollout.plan import RolloutPlan
from serving.rollout.state import CANARY, SHADOW, RolloutState


@dataclass(frozen=True)
class EvidenceDecision:
    cause: str  # what the decision log says
    extend_seconds: float | None  # None: advance to the next phase; else extend this one by that long


def next_for_evidence(state: RolloutState, plan: RolloutPlan, result: Analysis,
                      phase_seconds: float) -> EvidenceDecision | None:
    """The decision for an inconclusive ``result`` whose every inconclusive verdict is a gate that more requests
    would settle; None when anything else is inconclusive, or the evidence extensions are spent."""
    waiting = result.inconclusive()
    if not waiting:
        return None
    last = state.phase == CANARY and state.step_index == len(plan.steps) - 1
    if not last and all(A.may_collect_at_next_step(v, plan.gates) for v in waiting):
        gates = ", ".join(f"{v.gate} ~{v.more_samples} more candidate requests" if v.more_samples
                          else f"{v.gate} {v.candidate:.3g}" for v in waiting)
        return EvidenceDecision(f"analysis {result.look} passed but for gates short of evidence, judged again at "
                                f"the next phase: {gates}", None)
    if not all(A.collecting_evidence(v) for v in waiting):
        return None
    if state.evidence_extensions >= plan.max_evidence_extensions:
        return None
    more = max(v.more_samples or 0 for v in waiting)
    seconds = seconds_for(more, result, "shadow" if state.phase == SHADOW else "canary", phase_seconds)
    return EvidenceDecision(f"collecting evidence, {seconds:.0f} s more ({state.evidence_extensions + 1}/"
                            f"{plan.max_evidence_extensions}): {result.reasons}", seconds)


def seconds_for(more: int, result: Analysis, candidate_variant: str, phase_seconds: float) -> float:
    """How long the candidate's side takes to bring ``more`` requests at the rate seen in ``result``'s window
    (a tenth to spare), kept between a tenth of the phase and twice it."""
    seen = sum(row["requests"] for row in result.traffic if row["variant"] == candidate_variant)
    elapsed = max(result.until - result.since, 1e-9)
    needed = 1.1 * more * elapsed / seen if seen else 2 * phase_seconds
    return min(max(needed, phase_seconds / 10), 2 * phase_seconds)
