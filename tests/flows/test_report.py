"""The pipeline report's per-stage change line: what a stage did to the held-out evals, in points."""

from __future__ import annotations

from flows.report import stage_change_note


def test_stage_change_note_gives_each_shared_rate_in_points():
    before = {"task_accuracy": 1.0, "sampled_task_accuracy": 0.889, "refusal_rate": 0.907, "perplexity": 2.05}
    after = {"task_accuracy": 0.99, "sampled_task_accuracy": 0.95, "refusal_rate": 0.907, "perplexity": 2.04,
             "over_refusal_rate": 0.0}
    note = stage_change_note("grpo", "dpo", after, before)
    assert note == "grpo vs its input (dpo): task acc -1.0, sampled acc +6.1, refusal +0.0 points"


def test_stage_change_note_without_shared_metrics_says_so():
    assert stage_change_note("sft", "base", {"perplexity": 3.0}, {}) == "sft vs its input (base): no shared metrics"
