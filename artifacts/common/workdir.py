"""Where the project keeps its state: models, runs, the MLflow store, Prefect's home, the local fleet.

One resolution rule for every package: an explicit directory (a recipe's ``workdir:`` or a CLI flag) wins,
then ``$LIFECYCLE_HOME``, then ``<repo>/.lifecycle``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workdir:
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

    @property
    def deployments(self) -> Path:
        """Bundles `deploy snapshot` downloaded from the registry (verified, reused)."""
        return self.root / "deployments"

    @property
    def fleet(self) -> Path:
        """The local fleet `deploy` manages: gateway, replicas, keys, rollouts."""
        return self.root / "fleet"

    def tracking_uri(self) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.mlflow_db}"


def resolve_workdir(explicit: str | Path | None = None) -> Workdir:
    """`explicit` (recipe or CLI) wins, then $LIFECYCLE_HOME, then `<repo>/.lifecycle`."""
    raw = explicit or os.environ.get("LIFECYCLE_HOME") or REPO_ROOT / ".lifecycle"
    return Workdir(Path(raw).expanduser().resolve())


def resolve_tracking_uri(explicit: str | None = None, workdir: Workdir | None = None) -> str:
    """The MLflow store every command uses: an explicit URI (a ``--tracking-uri`` flag) wins, then
    ``$MLFLOW_TRACKING_URI``, then the pipeline's store in the workdir (``resolve_workdir()`` unless given)."""
    return explicit or (workdir or resolve_workdir()).tracking_uri()


def sqlite_artifact_root(tracking_uri: str, experiment: str) -> str | None:
    """For a sqlite store, the artifact location of ``experiment`` beside the database (``mlartifacts/``);
    MLflow's own default is ``./mlruns`` of whatever directory the command runs in. None for other stores."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri[len("sqlite:///"):].split("?", 1)[0])
    return (db.parent / "mlartifacts" / experiment).resolve().as_uri()
