"""Logging eval results into a real MLflow store (sqlite in tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.results import EvalResult, SliceResult, metrics_dict
from evals.tracking import log_results


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory):
    """One sqlite tracking store per module: creating its tables costs seconds, so tests share it."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture()
def mlflow_store(sqlite_uri, tmp_path):
    """A fresh experiment (artifacts under tmp_path) in the sqlite store; the previous URI is restored."""
    import mlflow

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(sqlite_uri)
    experiment_id = mlflow.create_experiment(f"evals-{tmp_path.name}",
                                             artifact_location=(tmp_path / "artifacts").as_uri())
    yield experiment_id
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(previous)


def _results() -> list[EvalResult]:
    return [
        EvalResult("task_accuracy", "task_accuracy", 0.5, 4,
                   {"addition": SliceResult(0.25, 2), "a+b (x)": SliceResult(0.75, 2)}),
        EvalResult("safety", "refusal_rate", 1.0, 3),
        EvalResult("perplexity", "perplexity", float("nan"), 0),
    ]


def test_log_results_writes_metrics_and_artifacts(mlflow_store, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    with mlflow.start_run(experiment_id=mlflow_store) as run:
        assert log_results(_results(), prefix="eval/") is True
    client = MlflowClient()
    metrics = client.get_run(run.info.run_id).data.metrics
    assert metrics == {"eval/task_accuracy": 0.5, "eval/task_accuracy/addition": 0.25,
                       "eval/task_accuracy/a_b _x_": 0.75, "eval/refusal_rate": 1.0}  # NaN left out
    names = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "evals")}
    assert names == {"eval_eval_results.md", "eval_eval_results.json"}
    local = Path(client.download_artifacts(run.info.run_id, "evals", str(tmp_path / "dl")))
    table = (local / "eval_eval_results.md").read_text()
    assert "| task_accuracy | task_accuracy | addition | 0.2500 | 2 |" in table
    record = json.loads((local / "eval_eval_results.json").read_text())
    assert [r["metric"] for r in record["results"]] == ["task_accuracy", "refusal_rate", "perplexity"]


def test_log_real_results_without_prefix(mlflow_store, micro_results):
    import mlflow
    from mlflow.tracking import MlflowClient

    with mlflow.start_run(experiment_id=mlflow_store) as run:
        log_results(micro_results)
    logged = MlflowClient().get_run(run.info.run_id).data.metrics
    assert logged == pytest.approx(metrics_dict(micro_results))


def test_no_active_run_warns_and_logs_nothing(mlflow_store):
    from mlflow.tracking import MlflowClient

    with pytest.warns(UserWarning, match="no active MLflow run"):
        assert log_results(_results()) is False
    assert MlflowClient().search_runs([mlflow_store]) == []
