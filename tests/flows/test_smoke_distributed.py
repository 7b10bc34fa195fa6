"""The shipped two-process recipe (configs/smoke-distributed.yaml) through the real CLI, Prefect and MLflow:
every training stage and the draft train in two gloo processes, and the pipeline finishes as on one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.flows.test_lifecycle import EXPECTED_STAGES, run_lifecycle

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "smoke-distributed.yaml"


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")  # the ephemeral server's start is test_stop_signals' subject, not this
def test_the_distributed_smoke_recipe_trains_every_stage_in_two_processes(tmp_path: Path) -> None:
    recipe = yaml.safe_load(RECIPE.read_text())
    assert all(recipe["training"][s]["distributed"]["num_processes"] == 2 for s in ("sft", "dpo", "grpo"))
    assert recipe["draft"]["distributed"]["num_processes"] == 2
    recipe["workdir"] = str(tmp_path / "workdir")
    # what this test is about ends with the bundles; rollouts are the other pipeline tests' (and ~80 s here)
    recipe["rollout"] = {"mode": "off"}
    path = tmp_path / "smoke-distributed.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))

    done = run_lifecycle(path, tmp_path / "summary.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["stages"]) == EXPECTED_STAGES
    for stage in ("sft", "dpo", "grpo"):  # rank 1 ran and wrote its log beside rank 0's output
        out = Path(summary["stages"][stage]["path"])
        assert (out / "workers" / "rank-1.log").is_file(), sorted(p.name for p in out.iterdir())
        assert 0.0 <= summary["evals"][stage]["task_accuracy"] <= 1.0
    draft = Path(summary["stages"]["draft"]["path"])
    assert (draft.parent / f".{draft.name}.workers" / "rank-1.log").is_file()
