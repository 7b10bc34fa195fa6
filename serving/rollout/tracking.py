"""One MLflow run per rollout: the plan as params, each analysis as a step of metrics, every decision as
the audit trail, and the artifacts a person reads to agree or disagree (comparison table and plot, top
disagreements, the timeline). MLflow keeps no alias history; this run is where it lives."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from artifacts.common.mlflow_batch import log_batch
from artifacts.common.workdir import sqlite_artifact_root
from artifacts.errors import RegistryError

EXPERIMENT = "rollouts"


class RolloutRun:
    def __init__(self, tracking_uri: str, run_id: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri or None)
        self.run_id = run_id

    def start(self, name: str, params: dict[str, str], tags: dict[str, str]) -> str:
        from mlflow.exceptions import MlflowException

        try:
            experiment = self.client.get_experiment_by_name(EXPERIMENT)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                EXPERIMENT, artifact_location=sqlite_artifact_root(self.tracking_uri, EXPERIMENT))
            run = self.client.create_run(experiment_id, run_name=name, tags={"lifecycle.kind": "rollout", **tags})
            self.run_id = run.info.run_id
            for key, value in params.items():
                self.client.log_param(self.run_id, key, value[:6000])
        except MlflowException as exc:
            raise RegistryError(f"rollout run: cannot start it in MLflow ({exc.message})") from exc
        return self.run_id

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        log_batch(self.run_id, metrics=metrics, step=step, client=self.client)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value)[:5000])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_png(self, figure, artifact_file: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / artifact_file
            figure.savefig(path, dpi=110, bbox_inches="tight")
            self.client.log_artifact(self.run_id, str(path))

    def log_json_lines(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        self.log_text("".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows), artifact_file)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
