"""The adapter release form (recipe ``release: {form: adapter}``, issue 33 item 4) through the real CLI, Prefect
engine and MLflow store, on the micro smoke recipe: the stages' adapters stacked into one, bundled against the base
bundle, evaluated on the base as a server's slot applies it, gated and registered with its base's version. The
rollout stage prints the `deploy` commands (`rollout.mode: manual`), which then work as printed; with `auto`, the
next version is rolled out in its lane of a rehearsal fleet of the base, judged by the recipe's plan; a recipe whose
gates the adapter fails registers it without the candidate alias and rolls nothing out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from artifacts.errors import ConfigError
from tests.flows.test_lifecycle import run_lifecycle

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_prefect_server")]


def _adapter_recipe(micro_recipe: Path, **changes) -> Path:
    recipe = yaml.safe_load(micro_recipe.read_text())
    recipe.update(release={"form": "adapter"}, quantize=None, draft=None, **changes)
    micro_recipe.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return micro_recipe


def test_the_adapter_form_ships_a_stacked_adapter_on_the_base_gated_as_served(micro_recipe, tmp_path):
    from mlflow import MlflowClient

    from artifacts.adapter_bundle import verify_adapter_bundle
    from artifacts.eval_record import read_eval_record
    from serving.rollout import RegistryConsole

    recipe = yaml.safe_load(micro_recipe.read_text())
    recipe["rollout"]["mode"] = "manual"
    micro_recipe.write_text(yaml.safe_dump(recipe, sort_keys=False))
    recipe = _adapter_recipe(micro_recipe)
    first = run_lifecycle(recipe, tmp_path / "first.json")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    summary = json.loads((tmp_path / "first.json").read_text())
    stages = summary["stages"]
    assert {"adapter", "bundle-base", "bundle-adapter", "eval-bundle-adapter", "release-adapter"} <= set(stages)
    assert not {"quantize", "draft", "bundle-fp", "release-fp"} & set(stages)  # no merged snapshot ships

    # one adapter of rank 4 + 4 + 4 on the base, bound to the base bundle by digest, its eval record beside it
    assert stages["adapter"]["ranks"] == [4, 4, 4]
    bundle, base_bundle = Path(stages["bundle-adapter"]["path"]), Path(stages["bundle-base"]["path"])
    manifest = verify_adapter_bundle(bundle, base=base_bundle)
    assert manifest.lora.rank == 12
    record = read_eval_record(bundle)
    assert record.passed and record.metrics["task_accuracy"] == summary["evals"]["bundle-adapter"]["task_accuracy"]

    # evaluated as served (unmerged, on the base) it scores what the merged chain scored: stacking is exact
    served, merged = summary["evals"]["bundle-adapter"], summary["evals"]["grpo"]
    assert served["task_accuracy"] == merged["task_accuracy"]
    assert served["format_adherence"] == merged["format_adherence"]
    assert served["perplexity"] == pytest.approx(merged["perplexity"], rel=1e-3)
    assert served["perplexity"] != pytest.approx(summary["evals"]["base"]["perplexity"], rel=1e-3)
    assert any(note.startswith("adapter: stacked sft r4 + dpo r4 + grpo r4 = rank 12") for note in summary["notes"])

    # registered: the base as a version of the recipe's model, the adapter as its own model with the base's version
    tracking = summary["tracking_uri"]
    client = MlflowClient(tracking)
    release = stages["release-adapter"]
    assert release["model_uri"] == "models:/micro-e2e-adapter/1" and release["alias"] == "candidate"
    adapter_version = client.get_model_version("micro-e2e-adapter", "1")
    assert adapter_version.tags["base_version"] == release["base_version"]
    assert adapter_version.tags["lifecycle.gates_passed"] == "true"
    assert str(client.get_model_version_by_alias("micro-e2e-adapter", "candidate").version) == "1"
    base_version = client.get_model_version("micro-e2e", release["base_version"])
    assert base_version.tags.get("lifecycle.kind") != "lora-adapter" and "lifecycle.gates_passed" in base_version.tags
    assert not client.get_registered_model("micro-e2e").aliases  # the base is no candidate
    # each version's own eval record, as a rollout controller reads it
    assert RegistryConsole("micro-e2e-adapter", tracking).eval_record("1")["metrics"]["perplexity"] == \
        pytest.approx(served["perplexity"])
    base_record = RegistryConsole("micro-e2e", tracking).eval_record(release["base_version"])
    assert base_record["metrics"]["perplexity"] == pytest.approx(summary["evals"]["base"]["perplexity"])

    # the rollout goes on by hand, in the base's lane, and the lines say how
    rollout = summary["rollout"]
    assert rollout["result"] == "manual", rollout
    assert any(f"deploy snapshot models:/micro-e2e/{release['base_version']} --max-loras 4 --max-lora-rank 16"
               in line for line in rollout["lines"])  # slots that hold the stacked rank (12)
    assert any("deploy snapshot models:/micro-e2e-adapter/1 --probes" in line for line in rollout["lines"])
    _deploy_as_printed(rollout["lines"], summary, tmp_path)

    _rolled_out_in_its_lane(recipe, client, str(base_version.version), tmp_path)

    # a gate the adapter fails (planted in the recipe): registered for the record, no alias, nothing rolled out;
    # every stage before the release comes from the cache
    recipe = _adapter_recipe(recipe, gates=["task_accuracy >= 1.01"])
    third = run_lifecycle(recipe, tmp_path / "third.json")
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-5000:]
    summary = json.loads((tmp_path / "third.json").read_text())
    assert summary["stages"]["eval-bundle-adapter"]["cached"] and not summary["stages"]["release-adapter"]["cached"]
    release = summary["stages"]["release-adapter"]
    assert release["model_uri"] == "models:/micro-e2e-adapter/3" and "alias" not in release
    assert release["base_version"] == str(base_version.version)  # the same base bundle: found by its digest
    assert summary["rollout"]["result"] == "gates-failed"
    assert not read_eval_record(Path(release["path"])).passed


def _rolled_out_in_its_lane(recipe: Path, client, base_version: str, tmp_path: Path) -> None:
    """``rollout.mode: auto`` over the champion adapter v1 (deployed by hand above): the same adapter released again
    (another passing gate list re-runs only the release) is v2, and the stage rolls it out in the lane of a rehearsal
    fleet of the base, against v1 loaded beside it, under replayed traffic naming the adapter. The floor is measured
    and the shadow phase runs; there the smoke recipe's evals (8 examples) are too few for the offline comparison
    (20), so the A/A pauses for a person, saying so: never a rollback, and not a promotion the evidence could not
    carry. v1 stays champion, the version row says paused and how to roll v2 out by hand, and the rehearsal fleet
    is gone. (A lane's canary steps, promotion and rollback: tests/serving/test_adapter_rollout.py.)"""
    config = yaml.safe_load(recipe.read_text())
    config["rollout"]["mode"] = "auto"
    config["gates"] = [*config["gates"], "task_accuracy >= 0.0"]
    recipe.write_text(yaml.safe_dump(config, sort_keys=False))
    second = run_lifecycle(recipe, tmp_path / "second.json")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    summary = json.loads((tmp_path / "second.json").read_text())
    release = summary["stages"]["release-adapter"]
    assert release["model_uri"] == "models:/micro-e2e-adapter/2" and release["alias"] == "candidate"
    assert release["base_version"] == base_version
    rollout = summary["rollout"]
    assert (rollout["version"], rollout["result"]) == ("2", "paused"), rollout
    lines = "\n".join(rollout["lines"])
    assert "baseline → shadow" in lines and "shadow: unset → v2" in lines, lines
    assert "shadow → paused" in lines and "offline_accuracy (too few samples (8 candidate, 8 baseline" in lines
    (traffic,) = [line for line in rollout["lines"] if line.startswith("traffic: ")]
    assert "0 errors seen by users" in traffic, traffic
    assert str(client.get_model_version_by_alias("micro-e2e-adapter", "champion").version) == "1"
    tags = client.get_model_version("micro-e2e-adapter", "2").tags
    assert tags["rollout.state"] == "paused"
    assert tags["rollout.restart_with"].startswith("deploy snapshot models:/micro-e2e-adapter/2 --plan ")
    fleet = json.loads((Path(config["workdir"]) / "runs" / "micro-e2e" / "fleet" / "fleet.json").read_text())
    assert not fleet["replicas"] and not fleet["gateway_pid"], fleet  # the rehearsal fleet stopped with the stage


def _deploy_as_printed(lines: list[str], summary: dict, tmp_path: Path) -> None:
    """Run the `deploy` commands the rollout lines print, as a user would (with this test's fleet and store):
    the base with adapter slots, then the adapter, installed as its lane's first champion after a smoke check;
    a chat through the gateway naming the adapter is answered by it."""
    import shlex

    import httpx

    from tests.serving.fleet_support import deploy

    home, fleet = tmp_path / "workdir", tmp_path / "fleet"
    common = ["--fleet", str(fleet), "--tracking-uri", summary["tracking_uri"]]
    try:
        for line in (line for line in lines if "deploy snapshot " in line):
            command = shlex.split(line[line.index("deploy snapshot "):])[1:]
            serve = ["--threads", "1", "--kv-memory", "16MiB"] if "--max-loras" in command else []
            done = deploy(*command, *common, *serve, home=home)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "micro-e2e-adapter v1 is champion (first champion of the adapter)" in done.stdout, done.stdout
        record = json.loads((fleet / "fleet.json").read_text())
        key = (fleet / "traffic.key").read_text().strip()
        answer = httpx.post(f"{record['gateway_url']}/v1/chat/completions", timeout=60,
                            headers={"authorization": f"Bearer {key}"},
                            json={"model": "micro-e2e-adapter", "max_tokens": 6,
                                  "messages": [{"role": "user", "content": "What is 12 + 30?"}]})
        assert answer.status_code == 200 and answer.json()["model"] == "micro-e2e-adapter", answer.text
    finally:
        deploy("stop", *common, home=home)


@pytest.mark.parametrize(("changes", "message"), [
    ({"quantize": {"methods": ["gptq"]}}, "set quantize: null"),
    ({"draft": {"steps": 5}}, "set draft: null"),
    ({"training": {"sft": {"lora": {"qlora": True}}}}, "training.sft.lora.qlora: true"),
    ({"training": {"sft": {"enabled": False}, "dpo": {"enabled": False}, "grpo": {"enabled": False}}},
     "at least one enabled training stage"),
    ({"release": {"form": "adapter", "adapter_model": "micro-e2e"}}, "is the base's registered model"),
    ({"release": {"form": "lora"}}, "form: must be one of merged, adapter"),
])
def test_what_the_adapter_form_cannot_ship_is_one_line_before_any_stage(micro_recipe, changes, message):
    from flows.recipe import load_recipe

    recipe = yaml.safe_load(micro_recipe.read_text())
    recipe.update(release={"form": "adapter"}, quantize=None, draft=None)
    recipe.update(changes)
    micro_recipe.write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(ConfigError, match="release") as caught:
        load_recipe(micro_recipe)
    assert message in str(caught.value) and "\n" not in str(caught.value)
