"""Where the pipeline keeps its state, and the settings that keep Prefect and MLflow offline and quiet.

`prepare_environment` must run before `prefect` is imported: Prefect reads its settings once, at
import. Every default here can be overridden by the user's own environment variable.
"""

from __future__ import annotations

import os

from artifacts.common.workdir import REPO_ROOT, Workdir, resolve_workdir

__all__ = ["REPO_ROOT", "Workdir", "prepare_environment", "resolve_workdir", "worker_environment"]

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
    # MLflow draws a bar per artifact download (the rollout fetches bundles from the registry); our stage
    # logs already say what is being fetched.
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


def prepare_environment(workdir: Workdir) -> None:
    """Set offline/quiet defaults and point Prefect's home at the workdir (call before importing prefect)."""
    for name, value in _OFFLINE_DEFAULTS.items():
        os.environ.setdefault(name, value)
    workdir.root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(workdir.prefect_home))
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(workdir.prefect_home / "results"))
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
    os.environ["MLFLOW_TRACKING_URI"] = workdir.tracking_uri()


# What a stage reads from the environment besides the defaults above: Prefect's home and result storage, the
# workdir, the torch threads and the Hugging Face cache.
_STAGE_VARIABLES = ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "PREFECT_RESULTS_PERSIST_BY_DEFAULT",
                    "LIFECYCLE_HOME", "LIFECYCLE_TORCH_THREADS", "HF_HOME")


def worker_environment(tracking_uri: str) -> dict[str, str]:
    """This process's pipeline settings for a stage that runs in another process (a Ray worker, which does not
    inherit this environment): the MLflow store, Prefect's home and result storage, the offline defaults."""
    names = (*_OFFLINE_DEFAULTS, *_STAGE_VARIABLES)
    return {name: os.environ[name] for name in names if name in os.environ} | {"MLFLOW_TRACKING_URI": tracking_uri}
