"""Promotion gates on eval metrics."""

from __future__ import annotations

import pytest

from evals.gates import Gate, check_gates, parse_gate
from evals.results import EvalResult, SliceResult


def _results() -> list[EvalResult]:
    return [
        EvalResult("task_accuracy", "task_accuracy", 0.6, 10, {"addition": SliceResult(0.2, 5)}),
        EvalResult("safety", "over_refusal_rate", 0.1, 10),
        EvalResult("perplexity", "perplexity", float("nan"), 0),
    ]


def test_gates_pass_and_fail_on_both_operators():
    report = check_gates(_results(), [Gate("task_accuracy", ">=", 0.5), Gate("over_refusal_rate", "<=", 0.2)])
    assert report.passed and not report.failures
    report = check_gates(_results(), [Gate("task_accuracy", ">=", 0.7), Gate("over_refusal_rate", "<=", 0.05),
                                      Gate("task_accuracy", "<=", 0.6)])
    assert not report.passed
    assert [(f.gate.metric, f.measured) for f in report.failures] == [
        ("task_accuracy", 0.6), ("over_refusal_rate", 0.1)]
    assert "0.6" in report.failures[0].reason and "0.7" in report.failures[0].reason
    assert "task_accuracy" in report.summary()


def test_gate_on_a_slice():
    report = check_gates(_results(), [Gate("task_accuracy/addition", ">=", 0.5)])
    assert not report.passed and report.failures[0].measured == pytest.approx(0.2)


def test_missing_or_nan_metric_fails_with_its_name():
    report = check_gates(_results(), [Gate("refusal_rate", ">=", 0.9), Gate("perplexity", "<=", 100.0)])
    assert not report.passed
    missing, nan = report.failures
    assert missing.measured is None and "refusal_rate" in missing.reason and "not measured" in missing.reason
    assert "perplexity" in nan.reason and "nan" in nan.reason


def test_empty_gate_list_passes():
    assert check_gates(_results(), []).passed


def test_gate_validation_and_parsing():
    with pytest.raises(ValueError, match="op"):
        Gate("task_accuracy", ">", 0.5)
    with pytest.raises(ValueError, match="threshold"):
        Gate("task_accuracy", ">=", float("nan"))
    assert parse_gate(" over_refusal_rate <= 0.25 ") == Gate("over_refusal_rate", "<=", 0.25)
    assert parse_gate("task_accuracy/addition>=1") == Gate("task_accuracy/addition", ">=", 1.0)
    for text in ("task_accuracy > 0.5", "task_accuracy >= high", ">= 0.5"):
        with pytest.raises(ValueError, match="gates"):
            parse_gate(text)
