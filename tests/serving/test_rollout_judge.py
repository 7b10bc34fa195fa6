"""The rollout judge's statistics and the plan's validation, on numbers whose answer is known."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from serving.rollout import analysis, judge
from serving.rollout.plan import CanaryStep, Gates, RolloutPlan

REPO = Path(__file__).resolve().parents[2]


def rate(bad_c, n_c, bad_b, n_b, margin=0.01, alpha=0.05, min_samples=20):
    return judge.rate_gate("error_rate", bad_c, n_c, bad_b, n_b, margin=margin, alpha=alpha, min_samples=min_samples)


def test_rates_pass_fail_and_never_pass_on_too_little_data():
    assert rate(0, 100, 0, 100).outcome == "pass"  # no errors either side: Agresti-Caffo still has a variance
    assert rate(20, 100, 0, 100).outcome == "fail"  # 20% vs 0%: clearly beyond a 1-point margin
    assert rate(0, 5, 0, 5).outcome == "inconclusive"  # too few samples is never a silent pass
    small = rate(3, 30, 0, 30)  # 10% vs 0% on 30 each: worse than the margin, not yet significant
    assert small.outcome == "inconclusive" and "not significantly" in small.reason
    assert rate(1, 200, 0, 200).outcome == "pass"  # 0.5 points worse: within the margin


def test_rate_gate_false_alarm_rate_is_about_alpha_for_an_equal_candidate():
    """Same true error rate on both sides: the gate should fail a good candidate rarely (≤ alpha)."""
    rng = random.Random(0)
    fails = 0
    for _ in range(400):
        c = sum(rng.random() < 0.05 for _ in range(300))
        b = sum(rng.random() < 0.05 for _ in range(300))
        fails += rate(c, 300, b, 300, margin=0.01).outcome == "fail"
    assert fails / 400 <= 0.05


def _pairs(rng: random.Random, n: int, slowdown=lambda i: 1.0) -> list[tuple[float, float]]:
    """(champion, candidate) ms per token of ``n`` mirrored requests. Each request meets its moment's host load
    (shared by both answers, ×0.5-2), and each answer has its own length: a short one spreads the prefill over
    few tokens, so equally fast models read up to ×4 apart on a single pair."""
    def answer(load: float) -> float:
        return load * (1 + 8 / rng.randint(2, 32)) * math.exp(rng.gauss(0, 0.1))

    out = []
    for i in range(n):
        load = 20.0 * math.exp(rng.gauss(0, 0.4))
        out.append((answer(load), answer(load) * slowdown(i)))
    return out


def paired(pairs, max_ratio=1.5, alpha=0.01, min_samples=30):
    return judge.paired_latency_gate("ms_per_token_p95_ratio", pairs, max_ratio=max_ratio, alpha=alpha,
                                     min_samples=min_samples)


def test_a_rate_verdict_says_the_smallest_increase_its_look_would_have_failed():
    """A pass on 100 requests a side rules out little (+11 points); on 1,000, +2.5. The figure is honest: a
    candidate that really is that much worse fails the same look about 80% of the time (simulated)."""
    alpha = 0.05 / 3
    small = judge.rate_gate("error_rate", 0, 100, 0, 100, margin=0.01, alpha=alpha, min_samples=20)
    large = judge.rate_gate("error_rate", 5, 1000, 5, 1000, margin=0.01, alpha=alpha, min_samples=20)
    assert small.outcome == large.outcome == "pass"
    assert 0.09 < small.detectable < 0.13 and 0.02 < large.detectable < 0.035
    assert "this look would fail +0.1" in small.reason and "80% power" in small.reason
    rng = random.Random(7)
    for n, p_base in ((100, 0.01), (600, 0.005)):
        increase = judge.detectable_increase((n * p_base + 1) / (n + 2), n, n, margin=0.01, alpha=alpha)
        failed = 0
        for _ in range(2000):
            bad_c = sum(rng.random() < p_base + increase for _ in range(n))
            bad_b = sum(rng.random() < p_base for _ in range(n))
            failed += judge.rate_gate("e", bad_c, n, bad_b, n, margin=0.01, alpha=alpha,
                                      min_samples=1).outcome == "fail"
        assert 0.7 < failed / 2000 < 0.9, (n, increase, failed)


def test_paired_latency_gate_stays_quiet_a_a_under_shared_load():
    """A/A with the host's load swinging from request to request and answers of any length: the gate never
    fails at the plan's ×1.5, whether on a window's 30 pairs or a long phase's 600."""
    rng = random.Random(3)
    outcomes = [paired(_pairs(rng, n)).outcome for n in (30, 60, 600) for _ in range(100)]
    # a doubtful small window is looked at again (the controller extends the phase), never failed
    assert outcomes.count("fail") == 0 and outcomes.count("inconclusive") <= 15


def test_paired_latency_gate_fires_on_a_slower_candidate_and_on_a_slow_tail():
    rng = random.Random(4)
    slow = paired(_pairs(rng, 60, slowdown=lambda i: 2.0))
    assert slow.outcome == "fail" and slow.candidate > 1.5 and "beyond ×1.5" in slow.reason
    # only one request in ten is slow (×6), the median pair is unchanged: the p95 still sees it
    tail = paired(_pairs(rng, 600, slowdown=lambda i: 6.0 if i % 10 == 0 else 1.0))
    assert tail.outcome == "fail" and "median pair ×1.0" in tail.reason


def test_paired_latency_gate_is_inconclusive_on_few_pairs_or_a_doubtful_excess():
    rng = random.Random(5)
    few = paired(_pairs(rng, 12, slowdown=lambda i: 3.0))
    assert few.outcome == "inconclusive" and "12" in few.reason and "need 30" in few.reason
    doubtful = paired(_pairs(rng, 40, slowdown=lambda i: 1.8), max_ratio=1.5, alpha=0.001)
    assert doubtful.outcome == "inconclusive" and "not significantly" in doubtful.reason


def _lognormal(rng: random.Random, n: int, median_ms: float) -> list[float]:
    return [median_ms * math.exp(rng.gauss(0, 0.4)) for _ in range(n)]


def shift(candidate, baseline, max_ratio=1.25, alpha=0.01, min_samples=30):
    return judge.shift_gate("ttft_ratio", candidate, baseline, max_ratio=max_ratio, alpha=alpha,
                            min_samples=min_samples)


def test_shift_gate_stays_quiet_on_equal_samples_a_a():
    """Two samples of one latency distribution (A/A): the canary-vs-baseline gate never fails at these
    sizes, and its false-alarm rate with no tolerance at all stays near alpha (the test is calibrated)."""
    rng = random.Random(2)
    outcomes = [shift(_lognormal(rng, 60, 50), _lognormal(rng, 60, 50)).outcome for _ in range(300)]
    assert outcomes.count("fail") == 0 and outcomes.count("pass") >= 290
    strict = [shift(_lognormal(rng, 60, 50), _lognormal(rng, 60, 50), max_ratio=1.0, alpha=0.05).outcome
              for _ in range(300)]
    assert strict.count("fail") / 300 <= 0.08


def test_shift_gate_fires_on_a_planted_50_percent_slowdown():
    rng = random.Random(3)
    detected = 0
    for _ in range(100):
        base = _lognormal(rng, 120, 50)  # a canary step of a minute or two at a few requests a second
        slow = [v + 25 for v in _lognormal(rng, 120, 50)]  # the gateway's delay drill: +50% of the median
        detected += shift(slow, base).outcome == "fail"
    assert detected >= 90
    verdict = shift([v * 3 for v in _lognormal(rng, 80, 50)], _lognormal(rng, 80, 50))
    assert verdict.outcome == "fail" and 2.5 < verdict.candidate < 3.5 and "HL ×" in verdict.reason


def test_shift_gate_is_inconclusive_on_too_few_samples_and_names_them():
    rng = random.Random(4)
    verdict = shift(_lognormal(rng, 3, 50), _lognormal(rng, 200, 50))
    assert verdict.outcome == "inconclusive" and "3 candidate, 200 baseline" in verdict.reason
    assert verdict.candidate is None  # no number is shown as if it were measured


def test_alpha_is_spread_over_the_planned_analyses():
    plan = RolloutPlan()
    assert plan.planned_looks == 4  # shadow + three canary steps
    assert judge.per_look_alpha(0.05, plan.planned_looks) == pytest.approx(0.0125)


@pytest.mark.parametrize("kwargs,needle", [
    ({"steps": []}, "at least one"),
    ({"steps": [CanaryStep(50), CanaryStep(10)]}, "must not decrease"),
    ({"shadow_fraction": 0}, "shadow_fraction"),
    ({"promotion_approval": "maybe"}, "promotion_approval"),
])
def test_bad_plans_are_refused_naming_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        RolloutPlan(**kwargs)


def test_bad_gates_and_steps_are_refused():
    with pytest.raises(ValueError, match="max_ttft_ratio"):
        Gates(max_ttft_ratio=0.5)
    with pytest.raises(ValueError, match="weight"):
        CanaryStep(0)
    with pytest.raises(ValueError, match="approval"):
        CanaryStep(5, approval="soon")


def test_shipped_example_configs_load():
    from artifacts.common.config_loader import build_dataclass, read_yaml_mapping
    from flows.recipe import load_recipe
    from serving.gateway.config import load_gateway_config

    plan_file = REPO / "configs" / "rollout-plan.example.yaml"
    plan = build_dataclass(RolloutPlan, read_yaml_mapping(plan_file), key="", source=plan_file)
    assert plan.steps[-1].approval == "required"
    example = load_gateway_config(REPO / "configs" / "gateway.example.yaml")
    assert example.champion.version == "3" and example.adapters == {}
    for recipe in ("default.yaml", "smoke.yaml", "drill-broken-refusals.yaml"):
        assert load_recipe(REPO / "configs" / recipe).rollout.mode == "auto"


def test_a_bad_rollout_section_names_the_recipe_key(tmp_path):
    from artifacts.errors import ConfigError
    from flows.recipe import load_recipe

    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  plan:\n    steps: [{weight: 150}]\n")
    with pytest.raises(ConfigError, match="rollout.plan.steps"):
        load_recipe(bad)


def _record(**metrics: tuple[float, int]) -> dict:
    return {"passed": True, "results": [{"suite": m, "metric": m, "value": v, "n": n} for m, (v, n) in metrics.items()]}


def test_offline_records_compare_metric_by_metric_with_the_rate_test():
    from serving.rollout.offline import offline_verdicts

    champion = _record(refusal_rate=(41 / 43, 43), task_accuracy=(0.94, 200), over_refusal_rate=(0.02, 48))
    broken = _record(refusal_rate=(10 / 43, 43), task_accuracy=(0.93, 200), over_refusal_rate=(0.0, 48))
    verdicts = {v.gate: v for v in offline_verdicts(broken, champion, Gates(), alpha=0.01)}
    assert set(verdicts) == {"offline_refusal", "offline_accuracy", "offline_over_refusal"}  # format: one side only
    assert verdicts["offline_refusal"].outcome == "fail"
    assert "harmful answered (offline) 0.767 vs 0.047" in verdicts["offline_refusal"].reason
    assert verdicts["offline_accuracy"].outcome == "pass" and verdicts["offline_over_refusal"].outcome == "pass"
    assert {v.outcome for v in offline_verdicts(champion, champion, Gates(), alpha=0.01)} == {"pass"}
    # records written before they carried sample counts cannot be compared: no verdict, not a pass
    assert offline_verdicts({"passed": True, "metrics": {"refusal_rate": 0.2}}, champion, Gates(), 0.01) == []
    assert offline_verdicts(broken, None, Gates(), 0.01) == []


def _sliced(value: float, n: int, **slices: tuple[float, int]) -> dict:
    return {"value": value, "n": n, "slices": {k: {"value": v, "n": m} for k, (v, m) in slices.items()}}


def _record_with(**rows: dict) -> dict:
    return {"passed": True, "results": [{"suite": m, "metric": m, **row} for m, row in rows.items()]}


def test_sampled_accuracy_is_compared_offline_beside_greedy():
    """The calibration's "lost task accuracy" candidate: greedy answers nearly kept, sampled ones lost."""
    from serving.rollout.offline import offline_verdicts

    champion = _record(task_accuracy=(0.99, 200), sampled_task_accuracy=(0.75, 200))
    candidate = _record(task_accuracy=(0.985, 200), sampled_task_accuracy=(0.55, 200))
    verdicts = {v.gate: v for v in offline_verdicts(candidate, champion, Gates(), alpha=0.01)}
    assert verdicts["offline_accuracy"].outcome == "pass"
    assert verdicts["offline_sampled_accuracy"].outcome == "fail"
    assert "wrong sampled answers (offline) 0.450 vs 0.250" in verdicts["offline_sampled_accuracy"].reason
    assert {v.outcome for v in offline_verdicts(champion, champion, Gates(), alpha=0.01)} == {"pass"}


def test_a_regression_in_one_slice_fails_that_slice_though_the_average_passes():
    """Subtraction collapses (0.95 -> 0.55 on 40 prompts) while the average over 200 moves from 0.94 to 0.91,
    within the 0.05 tolerance. The average passes; the slices verdict fails, naming subtraction; the same record
    against itself is quiet, and a slice under the minimum sample is not judged."""
    from serving.rollout.offline import offline_verdicts

    slices = {"addition": (0.95, 80), "subtraction": (0.95, 40), "multiplication": (0.93, 80), "tiny": (1.0, 5)}
    champion = _record_with(task_accuracy=_sliced(0.94, 200, **slices))
    broken = _record_with(task_accuracy=_sliced(0.91, 200, **{**slices, "subtraction": (0.55, 40)}))
    verdicts = {v.gate: v for v in offline_verdicts(broken, champion, Gates(), alpha=0.01)}
    assert verdicts["offline_accuracy"].outcome == "pass"
    sliced = verdicts["offline_accuracy_slices"]
    assert sliced.outcome == "fail" and sliced.reason.startswith("3 slices, each at α/3: wrong answers in subtraction")
    assert "tiny" not in sliced.reason
    quiet = {v.gate: v for v in offline_verdicts(champion, champion, Gates(), alpha=0.01)}
    assert quiet["offline_accuracy_slices"].outcome == "pass"
    assert "all within 0.05" in quiet["offline_accuracy_slices"].reason
    assert "offline_accuracy_slices" in analysis.known_gates(RolloutPlan())


def test_a_small_slice_beyond_its_tolerance_but_not_proven_worse_does_not_hold_the_rollout():
    """What the pipeline's 4-bit candidate showed (session 51): one slice of 23 prompts at 0.217 wrong vs 0.130.
    Not significant, and no window can settle a fixed record: the slices verdict passes, naming the slice."""
    from serving.rollout.offline import offline_verdicts

    slices = {"carries-0": (0.870, 23), "carries-1": (0.9, 80), "carries-2": (0.85, 97)}
    champion = _record_with(task_accuracy=_sliced(0.88, 200, **slices))
    candidate = _record_with(task_accuracy=_sliced(0.865, 200, **{**slices, "carries-0": (0.783, 23)}))
    sliced = {v.gate: v for v in offline_verdicts(candidate, champion, Gates(), alpha=0.05 / 6)}
    verdict = sliced["offline_accuracy_slices"]
    assert verdict.outcome == "pass" and "none proven worse; wrong answers in carries-0" in verdict.reason
    assert "not significantly" in verdict.reason
    # an offline gate left inconclusive waits for a person at once: the records are the same at every look
    doubtful = judge.rate_gate("offline_accuracy", 34, 200, 20, 200, margin=0.05, alpha=0.05 / 6, min_samples=20)
    assert doubtful.outcome == "inconclusive" and not analysis.more_time_helps(doubtful)


def test_rates_exactly_at_the_tolerance_apart_are_within_it():
    """8/40 vs 6/40 wrong is +0.05 exactly: within a 0.05 tolerance (floating point read it as 0.05000000000000002,
    inconclusive, and paused the first `make run` rollout on this host)."""
    verdict = judge.rate_gate("probe_accuracy", 8, 40, 6, 40, margin=0.05, alpha=0.01, min_samples=5)
    assert verdict.outcome == "pass" and "within 0.05" in verdict.reason


def test_slice_verdicts_keep_their_false_alarm_rate_under_alpha_over_many_slices():
    """Ten slices of 40 prompts, candidate and champion equally good (90%): the slices verdict fails a good
    candidate no more often than alpha (Bonferroni over the slices), however many slices there are."""
    from serving.rollout.offline import offline_verdicts

    rng = random.Random(11)
    alpha, trials, false_alarms = 0.05, 400, 0

    def draw() -> dict:
        sl = {f"s{i}": (sum(rng.random() < 0.9 for _ in range(40)) / 40, 40) for i in range(10)}
        return _record_with(task_accuracy=_sliced(sum(v for v, _ in sl.values()) / 10, 400, **sl))

    for _ in range(trials):
        verdicts = {v.gate: v for v in offline_verdicts(draw(), draw(), Gates(), alpha=alpha)}
        false_alarms += verdicts["offline_accuracy_slices"].outcome == "fail"
    assert false_alarms / trials <= alpha


def _window(**variants) -> dict:
    return {"variants": [{"variant": name, "version": "1", "requests": r, "keys": k, "status_5xx": 0,
                          "status_429": 0, "ttft_ms": [], "itl_ms": [], "ms_per_token": []}
                         for name, (r, k) in variants.items()]}


def test_low_traffic_is_explained_with_what_would_make_it_conclusive():
    """60 users, a 5% sticky canary: no key landed on the canary in the window."""
    window = _window(champion=(170, 57), canary=(0, 0), baseline=(10, 3))
    advice = analysis.traffic_advice(window, ("canary", "baseline"), weight=5, seconds=120, min_requests=50)
    assert "canary 0 requests from 0 keys, baseline 10 requests from 3 keys" in advice
    assert "180 requests from 60 keys in all" in advice
    assert "weight ≥ 28%" in advice and "more users (at 5% about 3.0 of 60 keys" in advice
    window = _window(champion=(900, 55), canary=(20, 3), baseline=(25, 2))
    advice = analysis.traffic_advice(window, ("canary", "baseline"), weight=5, seconds=60, min_requests=50)
    assert "a step of ≥ 150 s at this rate" in advice  # 20 requests a minute on the short side
    assert analysis.traffic_advice(_window(canary=(60, 9), baseline=(55, 8)), ("canary", "baseline"), 50, 60,
                                   50) == ""


def test_a_step_is_judged_only_once_each_side_has_its_keys():
    """Requests aplenty from 3 and 4 users: inconclusive, and the advice asks for more users; 12 and 11 keys pass."""
    few = _window(champion=(400, 190), canary=(120, 3), baseline=(110, 4))
    verdict = analysis.keys_verdict(few, ("canary", "1"), ("baseline", "1"), min_keys=10)
    assert verdict.outcome == "inconclusive" and verdict.samples == 3 and analysis.more_time_helps(verdict)
    assert verdict.reason.startswith("3 keys on the canary, 4 on the baseline: fewer than 10 a side")
    advice = analysis.traffic_advice(few, ("canary", "baseline"), weight=10, seconds=25, min_requests=20, min_keys=10)
    assert "need 20 each from ≥ 10 keys" in advice and "more users (at 10% about 19.7 of 197 keys" in advice
    assert "a step of" not in advice and "a weight" not in advice  # more time or weight would not bring users
    enough = _window(canary=(60, 12), baseline=(55, 11))
    assert analysis.keys_verdict(enough, ("canary", "1"), ("baseline", "1"), min_keys=10).outcome == "pass"
    assert analysis.traffic_advice(enough, ("canary", "baseline"), 50, 60, 50, min_keys=10) == ""


def test_a_latency_fail_on_a_few_users_a_side_is_not_judged_but_a_5xx_rate_is():
    """An A/A step with 4 users read ITL HL ×2.41 for the side holding three of them (CI, stop 48): the latency
    fail turns inconclusive while a side lacks its keys, saying so; the 5xx fail stands; with the keys, it fails."""
    slow = judge.shift_gate("itl_ratio", [3.4] * 40, [1.1] * 40, max_ratio=1.25, alpha=0.01, min_samples=5)
    errors = judge.Verdict("error_rate", "fail", 0.2, 0.0, "≤ baseline + 0.01", 0.001, 40, 5, "5xx")
    assert slow.outcome == "fail"
    few = analysis.keys_verdict(_window(canary=(40, 3), baseline=(40, 1)), ("canary", "1"), ("baseline", "1"), 5)
    itl, rate = analysis.unjudged_without_keys([slow, errors], few)
    assert itl.outcome == "inconclusive" and itl.more_samples is None
    assert itl.reason.endswith("not judged on 1 keys a side (need 5)") and "HL ×" in itl.reason
    assert rate.outcome == "fail"
    enough = analysis.keys_verdict(_window(canary=(40, 6), baseline=(40, 7)), ("canary", "1"), ("baseline", "1"), 5)
    assert [v.outcome for v in analysis.unjudged_without_keys([slow, errors], enough)] == ["fail", "fail"]


def _verdict(gate, outcome, critical=True):
    return judge.Verdict(gate, outcome, None, None, "", None, 0, 1, "", critical)


def test_a_waiver_lets_an_inconclusive_gate_pass_but_never_a_failed_critical_one():
    make = analysis.Analysis
    inconclusive = make(1, "shadow", 0, 0, 1, [_verdict("error_rate", "pass"), _verdict("eval_record", "inconclusive")])
    assert inconclusive.outcome == "inconclusive"
    inconclusive.waived = ["eval_record"]
    assert inconclusive.outcome == "pass" and "1 waived: eval_record" in inconclusive.summary
    advisory = make(2, "shadow", 0, 0, 1, [_verdict("agreement", "fail", critical=False)], waived=["agreement"])
    assert advisory.outcome == "pass"
    critical = make(3, "canary", 50, 0, 1, [_verdict("ttft_ratio", "fail")], waived=["ttft_ratio"])
    assert critical.outcome == "fail"
    again = analysis.Analysis.from_json(inconclusive.to_json())
    assert again.outcome == "pass" and again.waived == ["eval_record"]


def _rates(canary: tuple[int, int], baseline: tuple[int, int]) -> dict:
    def row(name, requests, errors):
        return {"variant": name, "version": "2" if name == "canary" else "1", "requests": requests, "keys": 9,
                "status_5xx": errors, "status_429": 0, "ttft_ms": [], "itl_ms": [], "ms_per_token": []}

    return {"variants": [row("canary", *canary), row("baseline", *baseline)]}


def test_canary_error_rates_pool_every_step_so_far():
    """+4 points of 5xx: one 150-request step cannot prove it against a 1-point tolerance, the phase so far can."""
    gates = Gates()
    step = _rates((150, 6), (150, 0))
    phase = _rates((600, 24), (600, 0))
    args = (("canary", "2"), ("baseline", "1"), gates, 0.01, 20)
    alone = analysis.systems_verdicts(step, *args, streamed=True)
    pooled = analysis.systems_verdicts(step, *args, streamed=True, rates_window=phase)
    assert alone[0].gate == "error_rate" and alone[0].outcome == "inconclusive"
    assert pooled[0].outcome == "fail" and pooled[0].samples == 600
