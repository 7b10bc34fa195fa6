"""CPU training workers forked from one fork server that imported the libraries once (training.worker_forkserver):
held like processes, stopped by signal, their output where the launcher sends it. The training they do, and
that they die with a killed stage, are tests/training/test_distributed.py's."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from training.distributed_config import DistributedSettings
from training.forked_workers import ForkedWorker, fork_server
from training.launcher import WORKER_MODULE, launch_workers


def _blocked_job(tmp_path: Path) -> Path:
    """A job file no worker can read yet: a FIFO with no writer keeps the worker waiting (a hung worker, planted)."""
    job = tmp_path / "job.json"
    os.mkfifo(job)
    return job


def test_workers_are_forked_from_one_server_held_like_processes_and_stopped_by_signal(tmp_path):
    server = fork_server()
    assert fork_server() is server and server.alive()
    job = _blocked_job(tmp_path)
    with open(tmp_path / "out.log", "wb") as out:
        command = [WORKER_MODULE, str(job)]
        first = ForkedWorker(server, command, dict(os.environ), "probe-rank0", out.fileno(), out.fileno())
        second = ForkedWorker(server, command, dict(os.environ), "probe-rank1", out.fileno(), out.fileno())
    for worker, name in ((first, "probe-rank0"), (second, "probe-rank1")):
        process = psutil.Process(worker.pid)
        assert process.ppid() == server.process.pid and process.name() == name
        assert worker.poll() is None

    first.kill()
    second.terminate()
    assert first.wait(timeout=30) == -9 and second.wait(timeout=30) == -15
    assert server.alive() and fork_server() is server  # one worker's end is not the server's


def test_a_worker_writes_where_the_launcher_says_and_its_error_is_the_stages(tmp_path):
    with pytest.raises(RuntimeError, match=r"probe: worker rank [01] of 2 failed: ValueError: unknown job kind"):
        launch_workers({"kind": "nope"}, DistributedSettings(num_processes=2), "cpu", tmp_path, "probe")
    assert "ValueError: unknown job kind 'nope'" in (tmp_path / "rank-1.log").read_text()
    server = fork_server()
    with pytest.raises(RuntimeError, match="unknown job kind"):  # the next stage's workers: the same server
        launch_workers({"kind": "nope"}, DistributedSettings(num_processes=2), "cpu", tmp_path / "again", "probe")
    assert fork_server() is server
