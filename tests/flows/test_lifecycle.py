"""The whole pipeline on the shipped two-process smoke recipe (configs/smoke-distributed.yaml: configs/smoke.yaml
with SFT, DPO, GRPO and the draft each trained in two gloo processes), through the real CLI, Prefect engine and
MLflow store. Single-process training runs the same pipeline in the schedule, new-data and stop-signal tests."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

LIFECYCLE = [sys.executable, "-m", "flows.cli"]
DISTRIBUTED_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "smoke-distributed.yaml"
DISTRIBUTED_STAGES = ("sft", "dpo", "grpo")
EXPECTED_STAGES = {
    "base", "data", "eval-base", "sft", "eval-sft", "dpo", "eval-dpo", "grpo", "eval-grpo", "draft", "quantize",
    "bundle-fp", "eval-bundle-fp", "release-fp", "bundle-gptq", "eval-bundle-gptq", "release-gptq",
}


def run_lifecycle(recipe: Path, summary: Path) -> subprocess.CompletedProcess:
    # The recipe's workdir holds the MLflow store unless MLFLOW_TRACKING_URI says otherwise; other tests
    # (through mlflow.set_tracking_uri) may have left that variable set in this process.
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([*LIFECYCLE, "run", str(recipe), "--json-out", str(summary)], capture_output=True,
                          text=True, timeout=1800, cwd=Path(__file__).resolve().parents[2], env=env)


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")
def test_pipeline_runs_every_stage_in_two_processes_tracks_it_and_reruns_from_cache(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    recipe = yaml.safe_load(DISTRIBUTED_RECIPE.read_text())
    assert all(recipe["training"][s]["distributed"]["num_processes"] == 2 for s in DISTRIBUTED_STAGES)
    assert recipe["draft"]["distributed"]["num_processes"] == 2
    recipe.update(name="micro-e2e", workdir=str(tmp_path / "workdir"))
    # the rollout stage waits for a person before it promotes: the stage ends with the rollout unfinished, which
    # is what a pause does too (a pipeline run never waits for a person)
    recipe["rollout"]["plan"]["promotion_approval"] = "required"
    recipe_path = tmp_path / "micro.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    first = run_lifecycle(recipe_path, tmp_path / "first.json")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    summary = json.loads((tmp_path / "first.json").read_text())
    assert set(summary["stages"]) == EXPECTED_STAGES
    assert not any(stage["cached"] for stage in summary["stages"].values())
    for stage in DISTRIBUTED_STAGES:  # rank 1 ran and wrote its log beside rank 0's output
        out = Path(summary["stages"][stage]["path"])
        assert (out / "workers" / "rank-1.log").is_file(), sorted(p.name for p in out.iterdir())
    draft_dir = Path(summary["stages"]["draft"]["path"])
    assert (draft_dir.parent / f".{draft_dir.name}.workers" / "rank-1.log").is_file()
    assert "task acc" in first.stdout and "lifecycle ui" in first.stdout
    # third-party banners and housekeeping stay out of the terminal (gptqmodel's, imported by peft and by
    # transformers for the 4-bit checkpoint; MLflow's "Creating initial MLflow database tables")
    noise = [line for line in (first.stdout + first.stderr).splitlines()
             if line.lstrip().startswith(("INFO ", "WARN ")) or "GPT-QModel" in line or " INFO mlflow" in line]
    assert not noise, noise[:5]
    for label in ("base", "sft", "dpo", "grpo", "bundle-fp", "bundle-gptq"):
        metrics = summary["evals"][label]
        assert 0.0 <= metrics["task_accuracy"] <= 1.0 and metrics["perplexity"] > 1.0
        assert 0.0 <= metrics["sampled_task_accuracy"] <= metrics["task_pass_at_k"] <= 1.0
    change = {note.split(" vs ")[0]: note for note in summary["notes"] if " vs its input " in note}
    assert change["grpo"].startswith("grpo vs its input (dpo): task acc ") and "sampled acc" in change["grpo"]
    assert set(change) == {"sft", "dpo", "grpo"} and change["sft"].startswith("sft vs its input (base)")
    # the draft of the final model, and the command that serves the shipped bundle with it
    draft = summary["stages"]["draft"]
    assert draft["target"] == summary["stages"]["grpo"]["path"]
    assert json.loads((Path(draft["path"]) / "config.json").read_text())["num_hidden_layers"] == 1
    serve = (f"lifecycle serve {summary['stages']['release-gptq']['path']} --speculative-tokens 4 "
             f"--speculative-model {draft['path']}")
    assert any(serve in note for note in summary["notes"]), summary["notes"]

    # MLflow: one pipeline run, one nested run per stage, eval metrics on the eval runs.
    workdir = Path(yaml.safe_load(recipe_path.read_text())["workdir"])
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("micro-e2e")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("lifecycle.kind") == "pipeline"]
    assert len(parents) == 1
    children = {r.data.tags["lifecycle.stage"]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert set(children) == EXPECTED_STAGES
    assert "task_accuracy" in children["eval-sft"].data.metrics
    # DPO's on-policy pairs: mined here once, trained on by both workers, logged with their counts
    dpo_dir = Path(summary["stages"]["dpo"]["path"])
    mined = json.loads((dpo_dir / "on_policy_pairs.json").read_text())
    assert children["dpo"].data.metrics["on_policy_pairs"] == sum(mined["report"]["pairs"].values()) > 0
    assert children["sft"].data.params["input_model"] == summary["stages"]["base"]["path"]

    # The bundles verify, carry an eval record, and are registered; the shipped variant got the alias.
    from artifacts.verify import verify_bundle

    for variant in ("fp", "gptq"):
        bundle = Path(summary["stages"][f"bundle-{variant}"]["path"])
        verify_bundle(bundle)
        assert (bundle / "eval_record.json").is_file()
        assert summary["stages"][f"release-{variant}"]["gates_passed"] is True
    candidate = client.get_model_version_by_alias("micro-e2e", "candidate")
    assert candidate.tags["lifecycle.gates_passed"] == "true"
    assert str(candidate.version) == str(summary["stages"]["release-gptq"]["version"])

    # The first run has no champion: the fp bundle becomes champion, and the 4-bit candidate is rolled out
    # against it (the online check of the fidelity report), through a verdict of the controller.
    rollout = summary["rollout"]
    fp_version = str(summary["stages"]["release-fp"]["version"])
    assert rollout["version"] == str(summary["stages"]["release-gptq"]["version"]) != fp_version
    assert any(f"v{fp_version} is champion (first champion" in line for line in rollout["lines"]), rollout["lines"]
    assert rollout["result"] in ("awaiting_approval", "rolled_back", "paused") and rollout["mlflow_run_id"]
    assert any("rollout started" in line for line in rollout["lines"])
    if rollout["result"] != "rolled_back":
        _an_unfinished_rehearsal_says_what_rolls_it_out(rollout, client, tmp_path)

    # Second run: every stage comes from the cache and no stage opens a new MLflow run.
    second = run_lifecycle(recipe_path, tmp_path / "second.json")
    assert second.returncode == 0, second.stderr[-5000:]
    again = json.loads((tmp_path / "second.json").read_text())
    if rollout["result"] != "rolled_back":  # the unfinished rollout is not rehearsed again; the line says what to run
        (line,) = again["rollout"]["lines"]
        assert "not rolled out again by a re-run" in line and line.endswith(_restart_command(rollout)), line
    assert all(stage["cached"] for stage in again["stages"].values())
    assert again["evals"] == summary["evals"]
    assert len(client.search_runs([experiment.experiment_id])) == len(runs) + 1

    # Removing one stage's output directory re-runs exactly that stage; the others stay cached.
    (dpo_dir,) = (workdir / "runs" / "micro-e2e").glob("dpo-*")
    shutil.rmtree(dpo_dir)
    third = run_lifecycle(recipe_path, tmp_path / "third.json")
    assert third.returncode == 0, third.stderr[-5000:]
    rerun = json.loads((tmp_path / "third.json").read_text())
    assert [name for name, s in rerun["stages"].items() if not s["cached"]] == ["dpo"]

    # A gate no model can pass: the releases (whose key holds the gates) run again and fail, nothing is rolled out,
    # and the report names, per failed gate, the step that lost the metric (or that none reached it) and the
    # recipe keys to look at.
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe["gates"] = [*recipe.get("gates", []), "task_accuracy >= 1.01"]
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    fourth = run_lifecycle(recipe_path, tmp_path / "fourth.json")
    assert fourth.returncode == 0, fourth.stderr[-5000:]
    failed = json.loads((tmp_path / "fourth.json").read_text())
    assert {name for name, s in failed["stages"].items() if not s["cached"]} == {"release-fp", "release-gptq"}
    advice = [note for note in failed["notes"] if "task_accuracy >= 1.01 failed (" in note]
    assert [note.split(":")[0] for note in advice] == ["fp", "gptq"], failed["notes"]
    assert all(" look at training." in note or " look at quantize." in note for note in advice), advice
    assert "task_accuracy >= 1.01 failed (" in fourth.stdout and "failed its gates" in fourth.stdout
    assert failed["rollout"]["result"] == "gates-failed"


def _restart_command(rollout: dict) -> str:
    (line,) = [line for line in rollout["lines"] if "this rehearsal's fleet stops with the stage" in line]
    return re.search(r"same plan: (deploy snapshot \S+ --plan \S+ --wait)", line).group(1)


def _an_unfinished_rehearsal_says_what_rolls_it_out(rollout: dict, client, tmp_path: Path) -> None:
    """The stage stopped its rehearsal fleet with the rollout unfinished: the stage, and the version's tag in the
    registry, name the `deploy snapshot` command that rolls the version out under the same plan (written beside
    the rollout's state); `lifecycle rollout run DIR` says in one line that this rollout cannot go on, and why."""
    from serving.deploy.rollout_plan import load_plan
    from serving.rollout.state import StateFile

    command = _restart_command(rollout)
    words = command.split()
    assert words[:3] == ["deploy", "snapshot", f"models:/micro-e2e/{rollout['version']}"], command
    assert client.get_model_version("micro-e2e", rollout["version"]).tags["rollout.restart_with"] == command
    plan_file = Path(words[words.index("--plan") + 1])
    state = StateFile(plan_file.parent).load()
    assert load_plan(str(plan_file)) == state.spec.plan and state.spec.plan.promotion_approval == "required"
    assert state.spec.plan.probes.data_dir  # the replayed prompts travel with the plan

    resumed = subprocess.run([*LIFECYCLE, "rollout", "run", str(plan_file.parent)], capture_output=True, text=True,
                             timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert resumed.returncode == 2, resumed.stderr
    (error,) = resumed.stderr.strip().splitlines()
    assert error.startswith(f"error: rollout {state.id} ({state.phase}) cannot go on: its fleet is not running")
    assert error.endswith(command)
