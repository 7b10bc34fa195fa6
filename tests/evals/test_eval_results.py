"""Result records and their views: flat metrics, markdown table, atomic JSON."""

from __future__ import annotations

import json
import os

import pytest

from evals.errors import EvalError
from evals.results import (
    EvalResult,
    SliceResult,
    markdown_table,
    metrics_dict,
    read_results_json,
    write_results_json,
)


def _results() -> list[EvalResult]:
    return [
        EvalResult("task_accuracy", "task_accuracy", 0.5, 4,
                   {"addition": SliceResult(0.25, 2), "reverse": SliceResult(0.75, 2)}),
        EvalResult("safety", "refusal_rate", 1.0, 3),
        EvalResult("perplexity", "perplexity", 12345.678, 900),
    ]


def test_metrics_dict_flattens_slices_and_prefixes():
    assert metrics_dict(_results()) == {
        "task_accuracy": 0.5, "task_accuracy/addition": 0.25, "task_accuracy/reverse": 0.75,
        "refusal_rate": 1.0, "perplexity": 12345.678,
    }
    assert set(metrics_dict(_results(), prefix="eval/")) == {
        "eval/task_accuracy", "eval/task_accuracy/addition", "eval/task_accuracy/reverse",
        "eval/refusal_rate", "eval/perplexity"}


def test_markdown_table_has_a_row_per_metric_and_slice():
    table = markdown_table(_results())
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 5  # header + 3 metrics + 2 slices
    assert "| task_accuracy | task_accuracy | addition | 0.2500 | 2 |" in table
    assert "| safety | refusal_rate | (all) | 1.0000 | 3 |" in table


def test_json_round_trip_and_atomic_write(tmp_path):
    path = write_results_json(_results(), tmp_path / "out" / "eval.json")
    assert read_results_json(path) == _results()
    assert os.listdir(path.parent) == ["eval.json"]  # no temp file left behind
    assert json.loads(path.read_text())["results"][0]["slices"]["addition"] == {"n": 2, "value": 0.25}


def test_json_write_failure_leaves_old_file(tmp_path):
    path = write_results_json(_results(), tmp_path / "eval.json")
    before = path.read_text()
    bad = [EvalResult("x", "x", 1.0, 1, {"s": object()})]  # not JSON-serialisable
    with pytest.raises(TypeError):
        write_results_json(bad, path)
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["eval.json"]


def test_reading_a_bad_results_file_names_it(tmp_path):
    with pytest.raises(EvalError, match="missing.json"):
        read_results_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"results": [{"suite": "x"}]}')
    with pytest.raises(EvalError, match="bad.json"):
        read_results_json(bad)
