"""Log eval results to the active MLflow run: metrics in one batch, the table and JSON as artifacts."""

from __future__ import annotations

import re
import tempfile
import warnings
from pathlib import Path

from artifacts.common.mlflow_batch import log_batch
from evals.results import EvalResult, markdown_table, metrics_dict, results_to_json

_UNSAFE_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_key(key: str) -> str:
    """MLflow accepts letters, digits, ``_ - . space /``; a slice label like ``a+b`` becomes ``a_b``."""
    return _UNSAFE_KEY_CHARS.sub("_", key)


def log_results(results: list[EvalResult], prefix: str = "", artifact_dir: str = "evals") -> bool:
    """Log ``results`` into the active MLflow run; return False (and warn) if no run is active.

    Metrics go in one batch (NaN values are left out: MLflow charts cannot show them);
    ``<artifact_dir>/eval_results.md`` and ``.json`` hold the full table and record (named
    ``<prefix>_eval_results.*`` with a prefix, so several evaluations can share one run).
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    run = mlflow.active_run()
    if run is None:
        warnings.warn("log_results: no active MLflow run; eval results were not logged", stacklevel=2)
        return False
    client = MlflowClient()
    log_batch(run.info.run_id, metrics={mlflow_key(k): v for k, v in metrics_dict(results, prefix).items()},
              client=client)
    label = mlflow_key(prefix).strip("/ _").replace("/", "_").replace(" ", "_")
    stem = f"{label}_eval_results" if label else "eval_results"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / f"{stem}.md").write_text(markdown_table(results), encoding="utf-8")
        (Path(tmp) / f"{stem}.json").write_text(results_to_json(results), encoding="utf-8")
        client.log_artifacts(run.info.run_id, tmp, artifact_path=artifact_dir)
    return True
