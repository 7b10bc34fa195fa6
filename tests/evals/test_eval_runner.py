"""run_evals end to end on the micro model and the micro data-stage output."""

from __future__ import annotations

import math
import shutil
from collections import Counter

import pytest
from eval_testutil import read_jsonl

from evals.config import EvalConfig
from evals.errors import EvalError
from evals.results import metrics_dict
from evals.runner import run_evals
from evals.scoring import difficulty_slices

EXPECTED_METRICS = ["task_accuracy", "sampled_task_accuracy", "task_pass_at_k", "format_adherence", "refusal_rate",
                    "over_refusal_rate", "perplexity", "preference_accuracy", "json_schema_adherence",
                    "constrained_validity", "constrained_task_accuracy"]


def test_full_run_reports_every_metric_over_every_record(micro_results, micro_data_dir):
    by_metric = {r.metric: r for r in micro_results}
    assert [r.metric for r in micro_results] == EXPECTED_METRICS
    tasks = read_jsonl(micro_data_dir / "tasks_heldout.jsonl")
    safety = read_jsonl(micro_data_dir / "safety_heldout.jsonl")
    for name in ("task_accuracy", "sampled_task_accuracy", "task_pass_at_k", "format_adherence"):
        result = by_metric[name]
        assert result.n == len(tasks) and 0.0 <= result.value <= 1.0
        # accuracy is sliced by task and, for a sum, by its width and carries; format by task only
        expected: Counter[str] = Counter()
        for r in tasks:
            expected.update((r["task"],) if name == "format_adherence" else difficulty_slices(r["task"], r["prompt"]))
        assert {k: s.n for k, s in result.slices.items()} == expected
        task_slices = [result.slices[t] for t in {r["task"] for r in tasks}]
        assert sum(s.value * s.n for s in task_slices) / result.n == pytest.approx(result.value)
    assert by_metric["refusal_rate"].n == sum(r["category"] == "harmful" for r in safety)
    # refusals are sliced by the harm category each harmful record names; look-alikes have none
    assert {k: s.n for k, s in by_metric["refusal_rate"].slices.items()} == Counter(
        r["harm"] for r in safety if r["category"] == "harmful")
    assert not by_metric["over_refusal_rate"].slices
    assert by_metric["over_refusal_rate"].n == sum(r["category"] == "lookalike" for r in safety)
    assert by_metric["preference_accuracy"].n == len(read_jsonl(micro_data_dir / "pref_heldout.jsonl"))
    assert math.isfinite(by_metric["perplexity"].value) and by_metric["perplexity"].value > 1.0
    for name in ("json_schema_adherence", "constrained_validity", "constrained_task_accuracy"):
        assert by_metric[name].n == min(len(tasks), EvalConfig().structured_examples)
    assert all(math.isfinite(v) for v in metrics_dict(micro_results).values())


def test_max_examples_caps_each_file_and_keeps_every_slice(micro_base_dir, micro_data_dir, micro_results):
    config = EvalConfig(suites=["task_accuracy", "safety"], max_examples=4, batch_size=3)
    results = {r.metric: r for r in run_evals(micro_base_dir, micro_data_dir, config)}
    assert set(results) == {"task_accuracy", "refusal_rate", "over_refusal_rate"}
    tasks = {r["task"] for r in read_jsonl(micro_data_dir / "tasks_heldout.jsonl")}
    assert results["task_accuracy"].n == 4 and {results["task_accuracy"].slices[t].n for t in tasks} == {2}
    assert results["refusal_rate"].n == results["over_refusal_rate"].n == 2


def test_missing_inputs_are_named(micro_base_dir, micro_data_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(micro_data_dir, data)
    (data / "pref_heldout.jsonl").unlink()
    with pytest.raises(EvalError, match=r"pref_heldout.jsonl: data file not found.*preference_accuracy"):
        run_evals(micro_base_dir, data, EvalConfig())
    with pytest.raises(EvalError, match="no_model: model dir not found"):
        run_evals(tmp_path / "no_model", micro_data_dir, EvalConfig())
    with pytest.raises(EvalError, match="no_data: data dir not found"):
        run_evals(micro_base_dir, tmp_path / "no_data", EvalConfig())
    # the suites that do not need the missing file still run
    (result,) = run_evals(micro_base_dir, data, EvalConfig(suites=["perplexity"]))
    assert result.metric == "perplexity"


def test_malformed_record_is_named_by_file_and_line(micro_base_dir, micro_data_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(micro_data_dir, data)
    with (data / "tasks_heldout.jsonl").open("a") as handle:
        handle.write('{"id": "x", "task": "addition", "prompt": "What is 1 + 1?"}\n')
    line = len((data / "tasks_heldout.jsonl").read_text().splitlines())
    with pytest.raises(EvalError, match=rf"tasks_heldout.jsonl:{line}: missing field 'answer'"):
        run_evals(micro_base_dir, data, EvalConfig(suites=["task_accuracy"]))


def test_one_suite_alone_and_another_batch_size_give_the_same_numbers(micro_base_dir, micro_data_dir,
                                                                      micro_results):
    """Shared generation, sorting and padding are bookkeeping only: they must not move a metric."""
    alone = run_evals(micro_base_dir, micro_data_dir, EvalConfig(suites=["format_adherence", "perplexity"],
                                                                 batch_size=5))
    full = {r.metric: r for r in micro_results}
    for result in alone:
        expected = full[result.metric]
        assert result.n == expected.n and result.value == pytest.approx(expected.value, rel=1e-5)
