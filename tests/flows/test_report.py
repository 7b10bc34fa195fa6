"""The pipeline report's per-stage change line: what a stage did to the held-out evals, in points."""

from __future__ import annotations

from flows.report import PipelineReport, slice_table, stage_change_note


def test_stage_change_note_gives_each_shared_rate_in_points():
    before = {"task_accuracy": 1.0, "sampled_task_accuracy": 0.889, "refusal_rate": 0.907, "perplexity": 2.05}
    after = {"task_accuracy": 0.99, "sampled_task_accuracy": 0.95, "refusal_rate": 0.907, "perplexity": 2.04,
             "over_refusal_rate": 0.0}
    note = stage_change_note("grpo", "dpo", after, before)
    assert note == "grpo vs its input (dpo): task acc -1.0, sampled acc +6.1, refusal +0.0 points"


def test_stage_change_note_adds_where_the_stages_held_out_curve_started_and_ended():
    before, after = {"task_accuracy": 0.895}, {"task_accuracy": 0.94}
    training = {"heldout_greedy_accuracy_first": 0.906, "heldout_greedy_accuracy_last": 0.9375, "loss": 0.1}
    note = stage_change_note("grpo", "dpo", after, before, training)
    assert note == "grpo vs its input (dpo): task acc +4.5 points; held-out greedy during the stage 0.906 -> 0.938"
    assert stage_change_note("grpo", "dpo", after, before, {"loss": 0.1}).endswith("task acc +4.5 points")


def test_stage_change_note_without_shared_metrics_says_so():
    assert stage_change_note("sft", "base", {"perplexity": 3.0}, {}) == "sft vs its input (base): no shared metrics"


def test_slice_table_orders_tasks_widths_then_carries_numerically():
    evals = {"sft": {"task_accuracy": 0.5, "task_accuracy/addition": 0.5, "task_accuracy/carries-10": 0.1,
                     "task_accuracy/carries-2": 0.25, "task_accuracy/digits-2": 0.5, "task_accuracy/carries-0": 0.9},
             "grpo": {"task_accuracy": 0.7, "task_accuracy/addition": 0.7, "task_accuracy/carries-2": 0.5}}
    columns, rows = slice_table(evals)
    assert columns == ["addition", "digits-2", "carries-0", "carries-2", "carries-10"]
    assert rows == [("sft", ["0.500", "0.500", "0.900", "0.250", "0.100"]),
                    ("grpo", ["0.700", "–", "–", "0.500", "–"])]


def test_slice_table_is_empty_without_slices_and_the_report_leaves_it_out():
    assert slice_table({"base": {"task_accuracy": 0.2, "task_accuracy/addition": 0.2}}) == ([], [])
    report = PipelineReport("r")
    assert "by slice" not in report.to_markdown()
