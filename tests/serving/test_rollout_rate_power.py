"""Rate gates with power (issue 32 item 1): a 5xx or 429 gate passes only on enough requests to have failed the
increase it exists to catch, and the rollout collects them (at the next weight, or by an evidence extension sized
to the traffic) instead of passing on what little it saw.

The numbers are the defaults users get: a 1-point 5xx tolerance, +3 points to catch with 80% power, the
default plan's per-look alpha. The end-to-end tests run real replicas (threads) behind the real gateway with a
real MLflow store; the 5xx are the gateway's abort drill on the canary, injected on purpose.
"""

from __future__ import annotations

import random
import time

import httpx

from serving.rollout import analysis, judge
from serving.rollout.analysis import Analysis
from serving.rollout.controller import Controller
from serving.rollout.evidence import next_for_evidence
from serving.rollout.plan import CanaryStep, Gates, RolloutPlan
from serving.rollout.state import CANARY, RolloutSpec, RolloutState
from serving.rollout.traffic import TrafficGenerator, TrafficSpec
from tests.serving.rollout_support import MODEL, fast_plan, fleet, register_versions, spec_for

DEFAULTS = Gates()
ALPHA = analysis.planned_alpha(RolloutPlan())


def errors(bad_c: int, n_c: int, bad_b: int, n_b: int) -> judge.Verdict:
    return judge.rate_gate("error_rate", bad_c, n_c, bad_b, n_b, margin=DEFAULTS.max_error_rate_increase,
                           alpha=ALPHA, min_samples=20, label="5xx rate",
                           effect=DEFAULTS.detect_error_rate_increase, power=DEFAULTS.detect_power)


def test_a_rate_gate_passes_only_once_it_could_have_failed_its_design_increase():
    """No 5xx on 100 requests a side is not a pass: that look could fail only about +0.13. It says how many
    more requests it needs; with them, the same clean record passes."""
    short = errors(0, 100, 0, 100)
    assert short.outcome == "inconclusive" and short.detectable > DEFAULTS.detect_error_rate_increase
    assert short.more_samples > 300 and f"~{short.more_samples} more candidate requests" in short.reason
    assert analysis.collecting_evidence(short) and analysis.may_collect_at_next_step(short, DEFAULTS)
    n = 100 + short.more_samples
    enough = errors(0, n, 0, n)
    assert enough.outcome == "pass" and enough.detectable <= DEFAULTS.detect_error_rate_increase
    assert enough.more_samples == 0 and not analysis.collecting_evidence(enough)
    # an estimate above the tolerance, not significant, is still collecting (and not within its tolerance)
    above = errors(3, 100, 0, 100)
    assert above.outcome == "inconclusive" and "not significantly" in above.reason and above.more_samples
    assert not analysis.may_collect_at_next_step(above, DEFAULTS)
    assert errors(30, 300, 0, 300).outcome == "fail"  # +10 points: failed whatever the power
    # gates without a design increase keep the plain three-way answer (the probes, agreement)
    assert judge.rate_gate("probe_accuracy", 0, 100, 0, 100, margin=0.05, alpha=ALPHA,
                           min_samples=20).outcome == "pass"


def test_at_the_size_it_asks_for_the_gate_is_quiet_on_a_a_and_catches_plus_three_points():
    """Simulated: at the requests the gate asks for, an equal candidate fails at most alpha of the time, and one
    with +3 points of 5xx fails at least the design power (80%) of the time, never passing."""
    rng = random.Random(11)
    base_rate = 0.002
    start = errors(0, 100, 0, 100)
    n = 100 + start.more_samples
    outcomes = {"aa": [], "plus3": []}
    for _ in range(300):
        b = sum(rng.random() < base_rate for _ in range(n))
        outcomes["aa"].append(errors(sum(rng.random() < base_rate for _ in range(n)), n, b, n).outcome)
        outcomes["plus3"].append(errors(sum(rng.random() < base_rate + 0.03 for _ in range(n)), n, b, n).outcome)
    assert outcomes["aa"].count("fail") / 300 <= ALPHA + 0.01
    assert outcomes["plus3"].count("fail") / 300 >= 0.8 and "pass" not in outcomes["plus3"]


def _state(step_index: int, evidence_extensions: int = 0) -> tuple[RolloutState, RolloutPlan]:
    plan = RolloutPlan(steps=[CanaryStep(10, seconds=25), CanaryStep(50, seconds=25)])
    spec = RolloutSpec(model_name=MODEL, candidate_version="2", champion_version="1", candidate_replicas=[],
                       champion_replicas=[], plan=plan)
    return RolloutState("r", spec, phase=CANARY, step_index=step_index, evidence_extensions=evidence_extensions), plan


def _look(verdicts: list[judge.Verdict], canary_requests: int, seconds: float = 25.0) -> Analysis:
    return Analysis(3, CANARY, 10, 0.0, seconds, verdicts,
                    traffic=[{"variant": "canary", "version": "2", "requests": canary_requests, "keys": 30}])


def test_what_a_rollout_does_with_a_rate_short_of_requests():
    short, above = errors(0, 100, 0, 100), errors(3, 100, 0, 100)
    passed = judge.Verdict("ttft_ratio", "pass", 1.0, 1.0, "", 0.5, 100, 20, "")
    # within its tolerance at an early step: on to the next weight, where the pooled rate keeps collecting
    state, plan = _state(step_index=0)
    moved = next_for_evidence(state, plan, _look([short, passed], 100), phase_seconds=25)
    assert moved.extend_seconds is None and "judged again at the next phase" in moved.cause
    # above its tolerance at an early step: the step holds, for as long as the traffic needs (4 requests/s here)
    held = next_for_evidence(state, plan, _look([above, passed], 100), phase_seconds=25)
    expected = 1.1 * above.more_samples / 4
    assert held.extend_seconds == min(max(expected, 2.5), 50) and "collecting evidence" in held.cause
    # at the last step, even within its tolerance: it extends (promotion needs a powered rate gate)
    last, _ = _state(step_index=1)
    assert next_for_evidence(last, plan, _look([short], 400), phase_seconds=25).extend_seconds > 0
    # the rate extensions spent, or anything else inconclusive: the ordinary extension and pause take over
    spent, _ = _state(step_index=1, evidence_extensions=plan.max_evidence_extensions)
    assert next_for_evidence(spent, plan, _look([short], 400), phase_seconds=25) is None
    latency = judge.Verdict("ttft_ratio", "inconclusive", 1.4, 1.0, "", 0.2, 100, 20, "not significantly")
    assert next_for_evidence(state, plan, _look([short, latency], 100), phase_seconds=25) is None


def _mechanics_gates(**overrides) -> Gates:
    """The default rate tolerances and power; wide latency bands, which are not the subject and read high beside
    the suite's other worker (rollout_support.latency_not_the_subject)."""
    return Gates(**{"max_ttft_ratio": 3.0, "max_itl_ratio": 3.0, "max_ms_per_token_p95_ratio": 4.0,
                    "detect_ttft_ratio": 6.0, "detect_itl_ratio": 6.0, **overrides})


def _run(f, controller: Controller, seconds: float = 90) -> RolloutState:
    """Traffic capped at 80 requests a second (a 2-vCPU host reaches ~100 alone): the 3-second steps then hold
    ~180 canary requests on any host, short of the ~350 the A/A's design increase needs, so the last step extends
    for evidence everywhere (CI's faster host once promoted without one)."""
    traffic = TrafficGenerator(f["gateway_url"], f["user_key"],
                               TrafficSpec(concurrency=3, max_tokens=4, requests_per_second=80), model=MODEL).start()
    try:
        return controller.run_until_done(max_seconds=seconds, stop_when_waiting=True)
    finally:
        traffic.stop()


def _decisions(state: RolloutState, kind: str) -> list[dict]:
    return [d for d in state.decisions if d["kind"] == kind]


def test_a_clean_canary_is_promoted_only_once_its_5xx_gate_could_have_failed(tmp_path, tiny_model_dir):
    """A/A: the early step moves on with its rate still collecting, the last step extends by the time the traffic
    needs (evidence extensions, each sized from the requests it lacks), and the rollout promotes at the first look
    whose 5xx verdict could have failed the design increase. +0.05 here, not the default +0.03: ~350 requests a
    side instead of ~1,000, the same path in a third of the time."""
    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir})
    effect = 0.05
    plan = fast_plan(steps=[CanaryStep(25, seconds=3, min_requests=8, min_keys=5),
                            CanaryStep(50, seconds=3, min_requests=8, min_keys=5)],
                     max_extensions=1, max_evidence_extensions=4,
                     gates=_mechanics_gates(detect_error_rate_increase=effect, detect_rate_limited_increase=0.08))
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir) as f:
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2", plan, start="canary"))
        state = _run(f, controller)
    assert state.phase == "promoted", (state.phase, state.reason)
    phases = _decisions(state, "phase")
    assert [d["to"] for d in phases] == ["canary 25%", "canary 50%", "promoted"]
    assert "short of evidence, judged again at the next phase" in phases[1]["cause"]
    # evidence extensions held the last step; on a loaded runner a 3-second step can also lack its minimum
    # samples or keys, which the ordinary extension covers (seen with a calibration running beside the suite)
    extensions = _decisions(state, "extend")
    assert any("collecting evidence" in d["cause"] for d in extensions), "\n".join(d["cause"] for d in extensions)
    looks = [{v["gate"]: v for v in a["verdicts"]} for a in state.analyses]
    assert [v["error_rate"]["outcome"] for v in looks] == ["inconclusive"] * (len(looks) - 1) + ["pass"]
    assert all(v["error_rate"]["detectable"] > effect for v in looks[:-1])
    assert looks[-1]["error_rate"]["detectable"] <= effect and looks[-1]["error_rate"]["more_samples"] == 0
    # each look counted more requests than the one before (the canary's rates pool every step so far)
    counts = [v["error_rate"]["samples"] for v in looks]
    assert counts == sorted(counts) and counts[-1] > counts[0]


def test_plus_thirty_points_of_5xx_is_rolled_back_at_the_first_weight(tmp_path, tiny_model_dir):
    """Fault injected on purpose: the gateway's abort drill answers 30% of canary requests 503 (retried on the
    champion, so users see none). The first step never moves on with its 5xx rate above the tolerance: it holds
    (an evidence extension) until the rate is significant, and the rollout is rolled back by error_rate."""
    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir})
    plan = fast_plan(steps=[CanaryStep(25, seconds=3, min_requests=8, min_keys=5),
                            CanaryStep(50, seconds=3, min_requests=8, min_keys=5)],
                     max_extensions=1, gates=_mechanics_gates())
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir) as f:
        admin = {"authorization": f"Bearer {open(f['admin_key_file']).read()}"}
        httpx.put(f"{f['gateway_url']}/admin/routing", headers=admin,
                  json={"faults": {"canary": {"abort_percent": 30}}}).raise_for_status()
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2", plan, start="canary"))
        started = time.monotonic()
        state = _run(f, controller)
    assert state.phase == "rolled_back", (state.phase, state.reason)
    assert state.reason.startswith("gate failed") and "error_rate" in state.reason
    assert [d["to"] for d in _decisions(state, "phase")] == ["canary 25%", "rolled_back"]
    assert time.monotonic() - started < 60
