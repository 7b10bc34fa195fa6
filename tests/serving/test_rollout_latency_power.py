"""Latency gates with power (issue 32, the TTFT +25% scenario): a canary's TTFT or ITL gate fails a ratio
significantly beyond its tolerance (×1.10) and passes only on enough requests to have failed the slowdown it
exists to catch (×1.25) with the design power; the rollout collects them at the next weight or by an evidence
extension.

Why two numbers: with one (×1.25 tolerance), a ×1.25 slowdown sits on the boundary, and a look passes it about
half the time however many requests it has (the calibration promoted one of two such rollouts). The samples
here are log-normal latencies, seeded; the numbers are the defaults users get and the default plan's per-look
alpha. The rollouts themselves are calibrated with real `lifecycle serve` replicas
(benchmarks/rollout_calibration.py, scenarios aa and ttft25).
"""

from __future__ import annotations

import numpy as np
import pytest

from serving.rollout import analysis, judge
from serving.rollout.analysis import Analysis
from serving.rollout.evidence import next_for_evidence
from serving.rollout.plan import CanaryStep, Gates, RolloutPlan
from serving.rollout.state import CANARY, RolloutSpec, RolloutState

DEFAULTS = Gates()
PLAN = RolloutPlan(steps=[CanaryStep(10, seconds=25, min_requests=20), CanaryStep(50, seconds=25, min_requests=20)])
ALPHA = analysis.planned_alpha(PLAN)


def ttft_look(ratio: float, n: int, seed: int, sd: float = 0.5, gates: Gates = DEFAULTS,
              effect: float | None = DEFAULTS.detect_ttft_ratio) -> judge.Verdict:
    """One look at ``n`` requests a side whose TTFT is ``ratio`` × the baseline's (log-normal, spread ``sd``)."""
    rng = np.random.default_rng(seed)
    baseline = np.exp(rng.normal(2.5, sd, n))
    candidate = np.exp(rng.normal(2.5 + np.log(ratio), sd, n))
    return judge.shift_gate("ttft_ratio", list(candidate), list(baseline), max_ratio=gates.max_ttft_ratio,
                            alpha=ALPHA, min_samples=20, effect=effect, power=gates.detect_power)


def test_a_latency_gate_passes_only_once_it_could_have_failed_its_design_ratio():
    """An early step's 80 requests a side, no slowdown: within ×1.10, but that look could fail only ~×1.4, so
    it is inconclusive and says how many more requests would do. With them, the same null passes."""
    short = ttft_look(1.0, 80, seed=1)
    assert short.outcome == "inconclusive" and short.candidate <= DEFAULTS.max_ttft_ratio
    assert short.detectable > DEFAULTS.detect_ttft_ratio and short.more_samples > 0
    assert "not the ×1.25 this gate must catch" in short.reason and f"~{short.more_samples} more" in short.reason
    assert analysis.collecting_evidence(short)
    grown = ttft_look(1.0, round(1.3 * (80 + short.more_samples)), seed=1)  # new draws: some to spare
    assert grown.outcome == "pass", grown.reason
    assert grown.detectable <= DEFAULTS.detect_ttft_ratio and grown.more_samples == 0


def test_a_null_stays_quiet_and_the_design_slowdown_is_caught_never_passed():
    """60 looks each at 500 requests a side (the 50% step's ~450-600): A/A never fails and nearly always passes;
    TTFT ×1.25 fails at least 3 in 4 (the design power is 0.8) and never passes. The single ×1.25 tolerance of
    before passes the same slowdown in a large share of looks: the calibration's promoted ttft25 rollout."""
    seeds = range(60)
    null = [ttft_look(1.0, 500, seed=s).outcome for s in seeds]
    assert null.count("fail") == 0 and null.count("pass") >= 54, null
    slow = [ttft_look(1.25, 500, seed=100 + s).outcome for s in seeds]
    assert slow.count("pass") == 0 and slow.count("fail") >= 45, slow
    boundary = Gates(max_ttft_ratio=1.25, detect_ttft_ratio=2.0)
    old = [ttft_look(1.25, 500, seed=100 + s, gates=boundary, effect=None).outcome for s in seeds]
    assert old.count("pass") >= 15 and old.count("fail") <= 3, old


def test_a_significant_slowdown_fails_on_few_requests():
    """The power requirement holds back passes, not fails: ×2 on 40 requests a side fails at once."""
    slow = ttft_look(2.0, 40, seed=3)
    assert slow.outcome == "fail" and "beyond ×1.1" in slow.reason


def _state(step_index: int, evidence_extensions: int = 0) -> RolloutState:
    spec = RolloutSpec(model_name="m", candidate_version="2", champion_version="1", candidate_replicas=[],
                       champion_replicas=[], plan=PLAN)
    return RolloutState("r", spec, phase=CANARY, step_index=step_index, evidence_extensions=evidence_extensions)


def _look(verdicts: list[judge.Verdict], canary_requests: int, seconds: float = 25.0) -> Analysis:
    return Analysis(3, CANARY, 10, 0.0, seconds, verdicts,
                    traffic=[{"variant": "canary", "version": "2", "requests": canary_requests, "keys": 30}])


def test_what_a_rollout_does_with_a_latency_ratio_short_of_evidence():
    short = ttft_look(1.0, 80, seed=1)  # within the tolerance, short of power
    between = ttft_look(1.18, 80, seed=1)  # above the tolerance, below the design ratio, not significant
    beyond = ttft_look(1.3, 80, seed=1)  # at the design ratio, not yet significant
    assert between.outcome == beyond.outcome == "inconclusive"
    assert DEFAULTS.max_ttft_ratio < between.candidate <= DEFAULTS.detect_ttft_ratio < beyond.candidate
    # an early step: a ratio below the design slowdown is judged again at the next weight (its own window)
    for verdict in (short, between):
        moved = next_for_evidence(_state(0), PLAN, _look([verdict], 80), phase_seconds=25)
        assert moved.extend_seconds is None and "judged again at the next phase" in moved.cause
    # beyond it: the step holds for as long as the traffic needs to bring the requests (3.2 requests/s here)
    held = next_for_evidence(_state(0), PLAN, _look([beyond], 80), phase_seconds=25)
    assert held.extend_seconds == pytest.approx(min(max(1.1 * beyond.more_samples / 3.2, 2.5), 50))
    assert "collecting evidence" in held.cause
    # the last step: promotion needs a powered latency gate, so even a clean ratio extends
    assert next_for_evidence(_state(1), PLAN, _look([short], 80), phase_seconds=25).extend_seconds > 0
    # the evidence extensions spent: the ordinary extension and pause take over
    spent = _state(1, evidence_extensions=PLAN.max_evidence_extensions)
    assert next_for_evidence(spent, PLAN, _look([short], 80), phase_seconds=25) is None


def test_the_design_ratio_must_lie_beyond_the_tolerance():
    with pytest.raises(ValueError, match="detect_ttft_ratio"):
        Gates(max_ttft_ratio=1.25, detect_ttft_ratio=1.25)
    with pytest.raises(ValueError, match="detect_itl_ratio"):
        Gates(max_itl_ratio=1.3)


def test_a_rollout_saved_before_the_rename_still_loads():
    """A paused rollout's state.json from before evidence extensions were shared by the latency gates."""
    state = _state(1, evidence_extensions=1)
    data = state.to_json()
    data["rate_extensions"], data["rate_extra_seconds"] = data.pop("evidence_extensions"), 12.5
    data.pop("evidence_extra_seconds")
    plan = data["spec"]["plan"]
    plan["max_rate_extensions"] = plan.pop("max_evidence_extensions")
    loaded = RolloutState.from_json(data)
    assert loaded.evidence_extensions == 1 and loaded.evidence_extra_seconds == 12.5
    assert loaded.spec.plan.max_evidence_extensions == PLAN.max_evidence_extensions
