"""A dataset directory that grows: a bad new file fails that run, naming the file and the field, and leaves
the last good outputs and aliases untouched. By hand the preflight refuses it in one line; unattended (a
worker running the flow) the data stage fails the run and someone hears about it (log + webhook)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_prefect_server")]


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]}


class _Webhook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["content-length"]))
        _Webhook.received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


# What a process worker does with a deployment's run: set up the workdir's environment, call the flow.
WORKER_ENTRY = ["-c", "import sys; from artifacts.common.workdir import resolve_workdir; "
                "from flows.environment import prepare_environment; prepare_environment(resolve_workdir()); "
                "from flows.lifecycle import lifecycle; lifecycle(recipe_path=sys.argv[1])"]


def test_a_bad_new_file_fails_that_run_names_it_notifies_and_changes_nothing(tmp_path):
    home, incoming = tmp_path / "home", tmp_path / "incoming"
    incoming.mkdir()
    (incoming / "day1.jsonl").write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(16)))
    recipe = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    recipe.update(name="newdata", workdir=str(home), quantize=None, gates=[])
    recipe["data"]["sft_path"] = str(incoming)
    recipe["rollout"]["mode"] = "off"
    for stage in ("dpo", "grpo"):
        recipe["training"][stage]["enabled"] = False
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))

    webhook = HTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=webhook.serve_forever, daemon=True).start()
    # Prefect's home is the workdir's; its API the suite's server (as a deployment's worker would have it)
    env = {k: v for k, v in os.environ.items()
           if k == "PREFECT_API_URL" or not k.startswith(("PREFECT_", "MLFLOW_TRACKING"))}
    env |= {"LIFECYCLE_HOME": str(home),
            "LIFECYCLE_NOTIFY_WEBHOOK": f"http://127.0.0.1:{webhook.server_address[1]}/hook"}

    def run(entry: list[str] | None = None) -> subprocess.CompletedProcess:
        command = entry or ["-m", "flows.cli", "run"]
        return subprocess.run([sys.executable, *command, str(path)], capture_output=True, text=True,
                              timeout=900, cwd=REPO, env=env)

    try:
        good = run()
        assert good.returncode == 0, good.stderr[-3000:]
        client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
        candidate = client.get_model_version_by_alias("newdata", "candidate").version
        (data_dir,) = (home / "runs" / "newdata").glob("data-*")

        (incoming / "day2.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "no reply"}]})
                                             + "\n")
        # by hand: the preflight refuses the recipe before any stage runs, in one line
        by_hand = run()
        assert by_hand.returncode == 2
        assert by_hand.stderr.strip().splitlines()[-1].startswith("error: ")
        assert "day2.jsonl: record 0 field 'messages'" in by_hand.stderr
        assert by_hand.stderr.count("Traceback") == 0
        assert not (home / "notifications.log").exists()  # the person at the keyboard already knows

        # unattended: a worker runs the flow itself (no preflight); the data stage fails the run
        scheduled = run(WORKER_ENTRY)
        assert scheduled.returncode != 0
        assert "day2.jsonl: record 0 field 'messages'" in scheduled.stderr + scheduled.stdout
        # nothing the good run made was touched; the failed data stage left no half-written output behind
        assert client.get_model_version_by_alias("newdata", "candidate").version == candidate
        assert (data_dir / "STAGE_DONE.json").is_file()
        assert [p for p in (home / "runs" / "newdata").glob("data-*") if (p / "STAGE_DONE.json").is_file()] \
            == [data_dir]
        # and somebody hears about it
        lines = [json.loads(line) for line in (home / "notifications.log").read_text().splitlines()]
        assert lines[-1]["state"] == "Failed" and "day2.jsonl" in lines[-1]["cause"]
        assert _Webhook.received and "day2.jsonl" in _Webhook.received[-1]["cause"]
    finally:
        webhook.shutdown()
