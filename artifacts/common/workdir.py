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
