"""Where the pipeline keeps its state, and the settings that keep Prefect and MLflow offline and quiet.

`prepare_environment` must run before `prefect` is imported: Prefect reads its settings once, at
import. Every default here can be overridden by the user's own environment variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

_OFFLINE_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # The ephemeral Prefect server needs longer than the 20 s default on a loaded 2-core machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_UI_ENABLED": "false",
    "GIT_PYTHON_REFRESH": "quiet",
}


@dataclass(frozen=True)
class Workdir:
    """The project data directory: models, datasets, MLflow store, Prefect state and results."""

    root: Path

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    @property
    def bundles(self) -> Path:
        return self.root / "bundles"

    def tracking_uri(self) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.mlflow_db}"


def resolve_workdir(explicit: str | Path | None = None) -> Workdir:
    """`explicit` (recipe or CLI) wins, then $LIFECYCLE_HOME, then `<repo>/.lifecycle`."""
    raw = explicit or os.environ.get("LIFECYCLE_HOME") or REPO_ROOT / ".lifecycle"
    return Workdir(Path(raw).expanduser().resolve())


def prepare_environment(workdir: Workdir) -> None:
    """Set offline/quiet defaults and point Prefect's home at the workdir (call before importing prefect)."""
    for name, value in _OFFLINE_DEFAULTS.items():
        os.environ.setdefault(name, value)
    workdir.root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(workdir.prefect_home))
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(workdir.prefect_home / "results"))
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
    os.environ["MLFLOW_TRACKING_URI"] = workdir.tracking_uri()
