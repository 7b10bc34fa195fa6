"""The lifecycle on a schedule, unattended, with real parts: a Prefect server and a process worker started
here on 127.0.0.1, a deployment of the smoke recipe firing every few seconds, a growing data directory, a
real MLflow store, and the Prefect UI in a real browser."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow import MlflowClient

from artifacts.common.net import free_port, wait_until_ready
from tests.browser import chromium_path, headless_page, page_text, save_screenshot, squash_whitespace

REPO = Path(__file__).resolve().parents[2]
LIFECYCLE = [sys.executable, "-m", "flows.cli"]
NAME = "sched-e2e"
pytestmark = pytest.mark.slow


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Say the number {i}."},
                         {"role": "assistant", "content": f"The number is {i}."}]}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")  # the way data should land in a watched directory: write, then rename
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(path)


class Proc:
    def __init__(self, args: list[str], env: dict, log: Path) -> None:
        self.log = log
        self.handle = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=self.handle, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.handle.close()


# The server's background services this test does not look at, off: it reads runs, states and artifacts, which
# the API writes, and needs the scheduler. The others digest every event of four pipeline runs: with them, the
# server used 74 s of CPU in this test alone (118 s in a run of the suite), without them 49 s, on two cores the
# other tests need. `lifecycle server` itself keeps them all for its users (the UI's event feed, late runs).
_ONLY_THE_SCHEDULER = {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in (
    "CANCELLATION_CLEANUP", "EVENT_PERSISTER", "FOREMAN", "LATE_RUNS", "PAUSE_EXPIRATIONS", "REPOSSESSOR",
    "CLEANUP_RECONCILER", "TASK_RUN_RECORDER", "TRIGGERS")}


def _api(method: str, url: str, attempts: int = 4, **kwargs) -> dict | list:
    """One Prefect API call, asked again on a timeout or a 5xx. With the suite's heaviest modules beside it, the
    Prefect server (SQLite) once took over 30 s to answer one filter (CI, session 41) and once answered a
    create_flow_run without a run (CI, session 44); a 4xx fails at once with the server's answer."""
    for attempt in range(attempts):
        try:
            response = httpx.request(method, url, timeout=30, **kwargs)
        except httpx.TimeoutException:
            if attempt == attempts - 1:
                raise
        else:
            if response.status_code < 500 or attempt == attempts - 1:
                break
        time.sleep(5)
    assert response.is_success, f"{method} {url}: {response.status_code} {response.text[:2000]}"
    return response.json()


def _runs(api: str, deployment_id: str) -> list[dict]:
    """The deployment's runs (the callers keep their own deadlines)."""
    return _api("POST", f"{api}/flow_runs/filter", json={
        "deployments": {"id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 200})


def _wait_runs(api: str, deployment_id: str, done: int, timeout: float, log: Path) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        final = [r for r in _runs(api, deployment_id) if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
        assert not [r for r in final if r["state_type"] != "COMPLETED"], (final, log.read_text()[-4000:])
        if len(final) >= done:
            return final
        time.sleep(2)
    raise AssertionError(f"fewer than {done} finished runs after {timeout:.0f} s:\n" + log.read_text()[-4000:])


def _pipeline_runs(client: MlflowClient, experiment_id: str) -> list:
    """The experiment's pipeline runs (the parents of the stage runs), finished or not."""
    return [r for r in client.search_runs([experiment_id], max_results=1000)
            if r.data.tags.get("lifecycle.kind") == "pipeline"]


def _stages_of(client: MlflowClient, experiment_id: str) -> dict[str, set[str]]:
    """Per pipeline run (MLflow run id): the stages that ran (cached stages open no MLflow run)."""
    runs = client.search_runs([experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("lifecycle.kind") == "pipeline" and r.info.status == "FINISHED"]
    return {p.info.run_id: {r.data.tags.get("lifecycle.stage") for r in runs
                            if r.data.tags.get("mlflow.parentRunId") == p.info.run_id} for p in parents}


def test_a_deployment_fires_by_itself_caches_picks_up_new_data_and_never_overlaps(tmp_path):
    home, data_dir = tmp_path / "home", tmp_path / "incoming"
    data_dir.mkdir()
    _write_jsonl(data_dir / "day1.jsonl", [_chat(i) for i in range(24)])
    recipe = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    # no 4-bit variant: the first run's fp release becomes the first champion after a smoke check, and the
    # day-2 release is rolled out against it (one rollout in the test, not two; quantizing is not what it is about)
    recipe.update(name=NAME, workdir=str(home), quantize=None)
    recipe["data"]["sft_path"] = str(data_dir)
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING"))}
    env |= {"LIFECYCLE_HOME": str(home), "PREFECT_API_SERVICES_SCHEDULER_LOOP_SECONDS": "2", **_ONLY_THE_SCHEDULER}
    server = Proc([*LIFECYCLE, "server", "--port", str(port)], env, tmp_path / "server.log")
    worker = None
    try:
        not_ready = wait_until_ready(f"{api}/health", 180, alive=lambda: server.proc.poll() is None, interval=1)
        assert not_ready is None, f"{not_ready}\n" + (tmp_path / "server.log").read_text()[-3000:]
        client_env = env | {"PREFECT_API_URL": api}
        scheduled = subprocess.run([*LIFECYCLE, "schedule", str(recipe_path), "--interval", "5s", "--name", NAME],
                                   env=client_env, cwd=REPO, capture_output=True, text=True, timeout=180)
        assert scheduled.returncode == 0, scheduled.stderr[-3000:]
        assert f"scheduled lifecycle/{NAME} (every 5s)" in scheduled.stdout
        deployment = _api("GET", f"{api}/deployments/name/lifecycle/{NAME}")
        worker = Proc([*LIFECYCLE, "worker", "--poll-seconds", "2"], client_env, tmp_path / "worker.log")

        # 1. two runs fire by themselves; the second finds nothing new
        final = _wait_runs(api, deployment["id"], 2, 900, tmp_path / "worker.log")
        mlflow = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
        experiment = mlflow.get_experiment_by_name(NAME)
        stages = _stages_of(mlflow, experiment.experiment_id)
        ran = sorted(stages.values(), key=len, reverse=True)
        assert {"base", "data", "sft", "release-fp"} <= ran[0] and ran[1] == set()  # run 2: all from cache
        reports = [mlflow.download_artifacts(run_id, "pipeline_report.md", str(tmp_path / run_id))
                   for run_id, st in stages.items() if not st]
        assert "no new data since run" in Path(reports[0]).read_text()
        assert final[0]["name"].startswith(f"{NAME}-data-")  # run names say recipe and data version
        assert mlflow.get_model_version_by_alias(NAME, "champion")  # rollout: auto made the first champion

        # 2. a new file in the data directory: the next run re-runs from the data stage on, not the base
        before = set(stages)
        _write_jsonl(data_dir / "day2.jsonl", [_chat(i) for i in range(100, 124)])
        added_at = time.time()
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            stages = _stages_of(mlflow, experiment.experiment_id)
            fresh = {k: v for k, v in stages.items() if k not in before and v}
            if fresh:
                break
            _wait_runs(api, deployment["id"], 1, 60, tmp_path / "worker.log")
            time.sleep(2)
        (new_run,) = fresh.values()
        assert "data" in new_run and "sft" in new_run and "base" not in new_run
        assert new_run >= {"eval-base", "dpo", "grpo", "bundle-fp", "eval-bundle-fp", "release-fp"}
        rollouts = mlflow.get_experiment_by_name("rollouts")
        versions = {r.data.tags.get("rollout.candidate")
                    for r in mlflow.search_runs([rollouts.experiment_id]) if r.info.start_time > added_at * 1000}
        assert versions, "the new candidate was not rolled out"

        # 3. runs of one deployment never overlap (one at a time; a run due meanwhile is cancelled)
        every = _runs(api, deployment["id"])
        assert any(r["state_type"] == "CANCELLED" for r in every)  # runs due meanwhile were turned away
        runs = [r for r in every if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
        runs.sort(key=lambda r: r["start_time"])
        for earlier, later in zip(runs, runs[1:]):
            assert later["start_time"] >= earlier["end_time"], (earlier["name"], later["name"])

        # 4. pause works: no run the schedule queued does anything after it (the scheduler may be inserting its
        # next batch at the moment of the pause); a run by hand of the deployment whose candidate fails its gates
        # runs, and is not rolled out
        assert subprocess.run([*LIFECYCLE, "schedule", "pause", NAME], env=client_env, cwd=REPO,
                              timeout=120).returncode == 0
        listed = json.loads(subprocess.run([*LIFECYCLE, "schedule", "list", "--json"], env=client_env, cwd=REPO,
                                           capture_output=True, text=True, timeout=120).stdout)
        assert [(d["name"], d["paused"]) for d in listed] == [(NAME, True)]
        time.sleep(8)  # let a run in progress finish
        _wait_idle(api, deployment["id"])
        pipelines_before = len(_pipeline_runs(mlflow, experiment.experiment_id))
        failing = dict(recipe, gates=["task_accuracy >= 2.0"])
        failing_path = tmp_path / "failing.yaml"
        failing_path.write_text(yaml.safe_dump(failing, sort_keys=False))
        champion_before = mlflow.get_model_version_by_alias(NAME, "champion").version
        n_rollouts = len(mlflow.search_runs([rollouts.experiment_id]))
        final_state = _run_by_hand(api, deployment["id"], {"recipe_path": str(failing_path)},
                                   tmp_path / "worker.log")
        assert final_state == "COMPLETED"
        time.sleep(6)  # more than one interval of the paused schedule
        _wait_idle(api, deployment["id"])
        assert len(_pipeline_runs(mlflow, experiment.experiment_id)) == pipelines_before + 1  # the run by hand only
        assert len(mlflow.search_runs([rollouts.experiment_id])) == n_rollouts  # no rollout started
        assert mlflow.get_model_version_by_alias(NAME, "champion").version == champion_before

        # 5. the Prefect UI shows the deployment, its schedule, and a run's artifacts
        if chromium_path() is not None and importlib.util.find_spec("playwright") is not None:
            ui = f"http://127.0.0.1:{port}"
            with headless_page() as page:
                text = squash_whitespace(page_text(page, f"{ui}/deployments/deployment/{deployment['id']}", NAME))
                assert "Every 5 seconds" in text or "every 5 seconds" in text.lower()
                save_screenshot(page, tmp_path / "prefect-deployment.png")
                run_id = final[0]["id"]
                page_text(page, f"{ui}/runs/flow-run/{run_id}", "Artifacts")
                page.get_by_text("Artifacts", exact=True).first.click()  # the run page's Artifacts tab
                page.wait_for_function("t => document.body.innerText.includes(t)", arg=f"lifecycle-{NAME}-evals")
                text = squash_whitespace(page.inner_text("body"))
                assert f"lifecycle-{NAME}-mlflow" in text and f"lifecycle-{NAME}-changes" in text
                assert "eval suites, every model" in text
                save_screenshot(page, tmp_path / "prefect-run-artifacts.png")
                print(f"screenshots in {tmp_path}")
    finally:
        if worker is not None:
            worker.stop()
        server.stop()


def _run_by_hand(api: str, deployment_id: str, parameters: dict, log: Path, timeout: float = 300) -> str:
    """Start a run of the deployment as a person would (the API's "run" button) and return its final state type.
    A run that meets another one of the deployment still going is cancelled by design (one at a time): wait for
    that one and ask again, up to three times."""
    for _ in range(3):
        created = _api("POST", f"{api}/deployments/{deployment_id}/create_flow_run", json={"parameters": parameters})
        deadline = time.monotonic() + timeout
        while (run := _api("GET", f"{api}/flow_runs/{created['id']}"))["state_type"] not in (
                "COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert time.monotonic() < deadline, (f"run {run['name']} still {run['state_name']} after {timeout:.0f} s:\n"
                                                 + log.read_text()[-3000:])
            time.sleep(2)
        message = (run.get("state") or {}).get("message") or ""
        if run["state_type"] != "CANCELLED" or "concurrency" not in message.lower():
            return run["state_type"]
        _wait_idle(api, deployment_id)
    raise AssertionError(f"three runs by hand were cancelled as colliding with scheduled ones: {message}")


def _wait_idle(api: str, deployment_id: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while any(r["state_type"] in ("RUNNING", "PENDING") for r in _runs(api, deployment_id)):
        assert time.monotonic() < deadline
        time.sleep(2)


def test_only_a_run_the_schedule_queued_is_skipped_once_it_is_paused():
    from flows.schedule import skip_reason

    assert skip_reason(auto_scheduled=True, deployment_paused=True, deployment_name="nightly").startswith(
        "skipped: the schedule of lifecycle/nightly is paused")
    assert skip_reason(auto_scheduled=False, deployment_paused=True, deployment_name="nightly") is None  # by hand
    assert skip_reason(auto_scheduled=True, deployment_paused=False, deployment_name="nightly") is None
