"""The rollout judge's statistics and the plan's validation, on numbers whose answer is known."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from serving.rollout import judge
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


def test_latency_gate_uses_the_p95_exceedance():
    rng = random.Random(1)
    base = [rng.gauss(100, 10) for _ in range(200)]
    same = [rng.gauss(100, 10) for _ in range(200)]
    slow = [rng.gauss(300, 30) for _ in range(200)]
    assert judge.latency_gate("ttft", same, base, max_ratio=1.5, alpha=0.05, min_samples=20).outcome == "pass"
    verdict = judge.latency_gate("ttft", slow, base, max_ratio=1.5, alpha=0.05, min_samples=20)
    assert verdict.outcome == "fail" and verdict.candidate > 2.5
    assert judge.latency_gate("ttft", slow[:5], base, max_ratio=1.5, alpha=0.05,
                              min_samples=20).outcome == "inconclusive"
    # a slow tail on a few requests only: above the ratio on p95 but not significantly so → look again
    tail = same[:180] + [400.0] * 12
    assert judge.latency_gate("ttft", tail, base, max_ratio=1.5, alpha=0.001, min_samples=20).outcome in (
        "inconclusive", "fail")


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
    with pytest.raises(ValueError, match="max_ttft_p95_ratio"):
        Gates(max_ttft_p95_ratio=0.5)
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
    assert load_gateway_config(REPO / "configs" / "gateway.example.yaml").champion.version == "3"
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
    from serving.rollout.analysis import offline_verdicts

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
