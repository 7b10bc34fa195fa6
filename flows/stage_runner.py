"""One Prefect task that runs any pipeline stage: cached, tracked in MLflow, restart-safe.

Why one generic task: every stage has the same life — derive a key from its config and its
inputs' keys, write into a directory named by that key, log params/metrics into a nested MLflow
run, and mark the directory done last. Prefect caches on the key, and the flow refreshes that
cache whenever the directory is not done, so deleting an output re-runs exactly that stage, and a
stage killed half-way is re-run (the stage itself resumes from its checkpoints).

`STAGE_DONE.json` is the one record that a pipeline stage is done, for every stage. A training stage's own
directory also holds training's `.training-finished.json` (training.checkpoints): that one says only that the
fine-tune itself finished, so that a stage re-run after the fine-tune but before this record (a crash while
logging) reuses the trained model instead of training it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import httpx
import mlflow
from mlflow.exceptions import MlflowException
from prefect import task
from prefect.context import TaskRunContext
from rich.console import Console

from artifacts.common.atomic import atomic_write_json
from artifacts.digests import digest_json
from artifacts.errors import LifecycleError
from flows.ray_runner import at_default_priority, ray_placement

console = Console(stderr=True)

DONE_MARKER = "STAGE_DONE.json"  # the stage's StageOutput, written last: the stage is done


@dataclass
class StageOutput:
    """What a finished stage hands to the next one (persisted as the Prefect task result)."""

    stage: str
    key: str
    path: str
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    seconds: float = 0.0
    cached: bool = False  # set by the flow when Prefect served this result from its cache


@dataclass
class StageWork:
    """What the stage must do: `run(out_dir, mlflow_run_id)` returns (metrics, info)."""

    stage: str
    key: str
    out_dir: Path
    run: Callable[[Path], tuple[dict[str, float], dict[str, Any]]]
    params: dict[str, Any] = field(default_factory=dict)


def stage_key(stage: str, config: Any, *upstream_keys: str, extra: Any = None) -> str:
    """Digest of everything that determines a stage's output: its config and its inputs' keys."""
    payload = asdict(config) if is_dataclass(config) else config
    return digest_json({"stage": stage, "config": payload, "upstream": list(upstream_keys), "extra": extra})


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    work: StageWork = parameters["work"]
    return f"{work.stage}-{work.key}"


def stage_is_done(out_dir: Path) -> bool:
    """Whether the stage that writes `out_dir` finished: only then is Prefect's cached result for it trusted."""
    return (out_dir / DONE_MARKER).is_file()


# MLflow's codes for a store that may answer on a second try (a locked sqlite file, a busy or throttled server).
_MLFLOW_TRANSIENT_CODES = {"TEMPORARILY_UNAVAILABLE", "RESOURCE_EXHAUSTED", "REQUEST_LIMIT_EXCEEDED"}


def is_transient_error(exc: BaseException) -> bool:
    """Whether a second try may get past `exc`: I/O and the network (OSError: a full disk, a refused or reset
    connection, TimeoutError, requests' and the Hugging Face hub's errors), an HTTP transport failure or a
    5xx/429 answer (httpx: Prefect's client), or MLflow saying its store is busy or its server unreachable.

    A user error (LifecycleError) or a programming error (TypeError, AttributeError, KeyError, ...) would
    fail the same way again: not transient."""
    if isinstance(exc, LifecycleError):
        return False
    if isinstance(exc, OSError | httpx.TransportError):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    if isinstance(exc, MlflowException):
        if exc.error_code in _MLFLOW_TRANSIENT_CODES:
            return True
        # MLflow re-raises a failed HTTP request as its generic exception; what it was raised over says why
        inner = exc.__cause__ or exc.__context__
        return inner is not None and is_transient_error(inner)
    return False


def _is_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: retry a stage only for an error a second try may get past."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - sorted by is_transient_error
        return is_transient_error(exc)
    return False


def stage_task_body(work: StageWork, parent_run_id: str | None) -> StageOutput:
    """What `stage_task` does: run the work in a nested MLflow run, then record its directory as done."""
    started = time.perf_counter()
    at_default_priority()  # a Ray worker starts at niceness 15
    work.out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold cyan]▶ {work.stage}[/] → {work.out_dir}", highlight=False)
    # Beside its parent run: in a Ray worker no experiment is set, and MLflow would file the run under Default.
    experiment_id = mlflow.get_run(parent_run_id).info.experiment_id if parent_run_id else None
    with mlflow.start_run(run_name=work.stage, nested=parent_run_id is not None, parent_run_id=parent_run_id,
                          experiment_id=experiment_id) as run:
        mlflow.set_tags({"lifecycle.stage": work.stage, "lifecycle.stage_key": work.key})
        if work.params:
            mlflow.log_params(_flatten(work.params))
        metrics, info = work.run(work.out_dir)
        info.update(ray_placement())
        if metrics:
            mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
        mlflow.log_param("output_dir", str(work.out_dir))
        output = StageOutput(
            stage=work.stage,
            key=work.key,
            path=str(info.pop("path", work.out_dir)),
            metrics={k: float(v) for k, v in metrics.items()},
            info=info,
            mlflow_run_id=run.info.run_id,
            seconds=round(time.perf_counter() - started, 2),
        )
    summary = f" ({output.info['summary']})" if output.info.get("summary") else ""  # a stage's one-line what
    console.print(f"[green]✓ {work.stage}[/] in {output.seconds:.1f}s{summary}", highlight=False)
    _write_done_record(work.out_dir, output)
    return output


# Decorated here rather than with `@task` above the body: then `flows.stage_runner.stage_task_body` names the plain
# function, so a Ray worker unpickles it by reference (a function Python cannot find under its own name is
# pickled by value, module globals and all, and the terminal's console cannot be).
stage_task = task(
    name="stage",
    task_run_name="{work.stage}",
    cache_key_fn=_cache_key,
    persist_result=True,
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=_is_transient,
)(stage_task_body)


def _write_done_record(out_dir: Path, output: StageOutput) -> None:
    atomic_write_json(out_dir / DONE_MARKER, asdict(output), sort_keys=False)


def _flatten(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """MLflow params are flat strings of ≤6000 chars; nested configs become dotted keys."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if is_dataclass(value):
            value = asdict(value)
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:6000]
    return flat
