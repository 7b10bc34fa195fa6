"""The lifecycle flow's stage tasks on a real Ray head this test starts (recipe `runner: {kind: ray}`), and the
runner's refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from artifacts.common.net import free_port
from artifacts.errors import ConfigError
from flows.preflight import preflight
from flows.recipe import load_recipe
from tests.serving.ray_support import ray_cluster

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def ray_head() -> Iterator[str]:
    """A one-node Ray cluster with 2 CPUs (ray_support.py: its own temp dir and ports, started again if the node
    misses Ray's fixed registration wait on a loaded machine); yields HOST:PORT."""
    with ray_cluster(head_cpus=2, node_cpus=0) as cluster:
        yield cluster.address


def ray_recipe(micro_recipe: Path, address: str) -> Path:
    """The smoke recipe cut to base → data → SFT → the fp bundle, its stages on the Ray head."""
    recipe = yaml.safe_load(micro_recipe.read_text())
    recipe["training"]["dpo"]["enabled"] = recipe["training"]["grpo"]["enabled"] = False
    recipe["training"]["sft"]["max_steps"] = 2
    recipe.update(quantize=None, draft=None, gates=[], registry={"enabled": False}, rollout={"mode": "off"},
                  evals={"suites": ["perplexity"], "max_examples": 8}, runner={"kind": "ray", "address": address})
    micro_recipe.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return micro_recipe


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")
def test_stage_tasks_run_in_ray_workers_and_record_where(micro_recipe, ray_head, tmp_path):
    recipe = ray_recipe(micro_recipe, ray_head)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    flow = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(recipe), "--json-out",
                             str(tmp_path / "summary.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)
    out, err = flow.communicate(timeout=600)
    assert flow.returncode == 0, out[-3000:] + err[-5000:]
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert set(stages) == {"base", "data", "eval-base", "sft", "eval-sft", "bundle-fp", "eval-bundle-fp",
                           "release-fp"}
    # every stage ran as a Ray task: in a worker process of the head's one node, not in the flow's process
    assert {stage["ray_pid"] for stage in stages.values()}.isdisjoint({flow.pid})
    assert len({stage["ray_node"] for stage in stages.values()}) == 1
    if os.geteuid() == 0:  # only root may undo the niceness 15 Ray gives its workers
        assert {stage["ray_nice"] for stage in stages.values()} == {0}
    assert (Path(stages["sft"]["path"]) / "model.safetensors").is_file()
    # Ray's banners and its workers' output stay off the terminal; the flow says where each stage ran
    assert "✓ sft in" in err and "on Ray node" in err
    assert "Ray cluster" not in out + err and "Ray instance" not in out + err and "(pid=" not in out + err

    # the workers logged into the flow's MLflow store, each stage run nested under the pipeline's run
    from mlflow import MlflowClient

    workdir = Path(yaml.safe_load(recipe.read_text())["workdir"])
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("micro-e2e").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("lifecycle.kind") == "pipeline")
    assert parent.data.tags["lifecycle.runner"] == "ray"
    nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert {r.data.tags["lifecycle.stage"] for r in nested} == set(stages)
    assert "train/loss" in client.get_run(stages["sft"]["mlflow_run_id"]).data.metrics


@pytest.mark.parametrize("runner,message", [
    ({"kind": "spark"}, "runner: kind: must be one of local, ray, got 'spark'"),
    ({"kind": "local", "address": "10.0.0.1:6379"}, "runner: address: only a ray runner has one"),
    ({"kind": "ray", "address": "nowhere"}, "runner.address: 'nowhere' is not HOST:PORT"),
])
def test_a_bad_runner_is_one_line_naming_the_key(micro_recipe, runner, message):
    recipe = yaml.safe_load(micro_recipe.read_text())
    micro_recipe.write_text(yaml.safe_dump({**recipe, "runner": runner}))
    with pytest.raises(ConfigError, match=message) as caught:
        preflight(load_recipe(micro_recipe), micro_recipe)
    assert str(caught.value).startswith(str(micro_recipe)) and "\n" not in str(caught.value)


def test_a_ray_address_that_does_not_answer_fails_before_any_work(micro_recipe):
    recipe = yaml.safe_load(micro_recipe.read_text())
    address = f"127.0.0.1:{free_port()}"
    micro_recipe.write_text(yaml.safe_dump({**recipe, "runner": {"kind": "ray", "address": address}}))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=f"runner.address: no Ray cluster answers at {address} "
                                          r"\(Connection refused\); start one with"):
        preflight(load_recipe(micro_recipe), micro_recipe)
    assert time.monotonic() - started < 5


def test_training_stages_ask_ray_for_a_gpu_per_process_where_the_cluster_has_gpus(monkeypatch):
    from flows import ray_runner

    monkeypatch.setattr(ray_runner, "largest_node", lambda: {"CPU": 16.0, "GPU": 4.0})
    assert ray_runner.stage_resources(2, "auto", "training.sft.distributed.num_processes", "r.yaml") == {"num_gpus": 2}
    assert ray_runner.stage_resources(2, "cpu", "draft.distributed.num_processes", "r.yaml") == {"num_cpus": 2}
    with pytest.raises(ConfigError, match=r"r.yaml: training.sft.distributed.num_processes: 8 processes need 8 GPUs "
                                          r"on one Ray node; the largest node of the cluster has 4"):
        ray_runner.stage_resources(8, "auto", "training.sft.distributed.num_processes", "r.yaml")
    monkeypatch.setattr(ray_runner, "largest_node", lambda: {"CPU": 2.0, "GPU": 0.0})
    assert ray_runner.stage_resources(2, "auto", "training.sft.distributed.num_processes", "r.yaml") == {"num_cpus": 2}
