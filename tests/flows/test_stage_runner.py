"""A stage is retried only for an error a second try may get past, never for a bug or a user error."""

from __future__ import annotations

import errno

import httpx
import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
from prefect.states import Failed

from artifacts.errors import ConfigError
from flows.stage_runner import _is_transient, stage_task


def _mlflow_request_failed() -> MlflowException:
    """What MLflow raises when its HTTP request to the tracking server fails (no `from`, only a context)."""
    try:
        try:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        except Exception as e:
            raise MlflowException(f"API request to http://127.0.0.1:5000 failed with exception {e}")  # noqa: B904
    except MlflowException as exc:
        return exc


def _status_error(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1:4200/api/task_runs/")
    return httpx.HTTPStatusError("answered", request=request, response=httpx.Response(status, request=request))


@pytest.mark.parametrize("exc", [
    OSError(errno.ENOSPC, "No space left on device"),
    ConnectionResetError("reset by peer"),
    TimeoutError("timed out"),
    httpx.ConnectError("refused"),
    _status_error(503),
    MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE),
    _mlflow_request_failed(),
], ids=repr)
def test_io_network_and_store_hiccups_are_retried(exc: BaseException) -> None:
    assert _is_transient(None, None, Failed(data=exc))


@pytest.mark.parametrize("exc", [
    TypeError("run() missing 1 required positional argument"),
    AttributeError("'NoneType' object has no attribute 'path'"),
    KeyError("model.embed_tokens.weight"),
    ValueError("bad value"),
    ZeroDivisionError("division by zero"),
    ConfigError("training.sft.lr: must be > 0"),
    _status_error(404),
    MlflowException("Invalid metric", error_code=INVALID_PARAMETER_VALUE),
], ids=repr)
def test_programming_and_user_errors_fail_at_once(exc: BaseException) -> None:
    assert not _is_transient(None, None, Failed(data=exc))


def test_the_stage_task_retries_through_this_condition() -> None:
    assert stage_task.retries == 1 and stage_task.retry_condition_fn is _is_transient
