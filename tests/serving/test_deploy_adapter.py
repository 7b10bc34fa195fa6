"""`deploy snapshot` of a LoRA adapter, as a user runs it (issue 33, item 5): the base deployed with adapter slots,
an adapter bundle directory registered and installed as the first champion of its lane, a wrong-base adapter
refused with one line, a new version rolled out (A/A) in the base's replicas and promoted while traffic runs, the
version that lost unloaded, another version rolled back by hand with `deploy rollback --adapter`, and `deploy
status` showing the adapter's lane and rollout; a new base's install warns that it serves none of the old one's
adapters. Real processes: the `deploy` CLI, the fleet's gateway and replica,
the rollout controller; a sqlite MLflow store.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow import MlflowClient

from serving.rollout.plan import CanaryStep
from serving.rollout.state import StateFile
from serving.rollout.traffic import TrafficGenerator, TrafficSpec
from tests.lora_support import make_adapter
from tests.serving.fleet_support import deploy
from tests.serving.rollout_support import MODEL, fast_plan, register_versions

ADAPTER_MODEL = "support-adapter"
TARGETS = ["q_proj", "v_proj", "down_proj"]

pytestmark = pytest.mark.slow


def _record(fleet_dir: Path) -> dict:
    return json.loads((fleet_dir / "fleet.json").read_text())


def _wait_phase(directory: Path, phases: set[str], timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = StateFile(directory).load()
        if state.phase in phases:
            return state
        time.sleep(0.5)
    raise AssertionError(f"rollout in {directory} never reached {phases}: {StateFile(directory).load().phase}")


def _adapter_bundles(tmp: Path, micro_base_dir: Path, base_bundle: Path) -> dict[str, Path]:
    from artifacts.adapter_bundle import write_adapter_bundle
    from artifacts.manifest import Lineage
    from artifacts.writer import BundleConfig, write_bundle

    support = make_adapter(micro_base_dir, tmp / "peft-support", rank=4, seed=31, targets=TARGETS)
    other = make_adapter(micro_base_dir, tmp / "peft-other", rank=4, seed=32, targets=TARGETS)
    another_base = write_bundle(micro_base_dir, tmp / "another-base", BundleConfig(name=MODEL, version="retrained",
                                                                                   max_shard_size="100KB"),
                                Lineage(base_model="test:retrained"))
    return {"v1": write_adapter_bundle(support, tmp / "support-1", base_bundle, name="support", version="1"),
            "v2": write_adapter_bundle(support, tmp / "support-2", base_bundle, name="support", version="2"),
            "v3": write_adapter_bundle(other, tmp / "support-3", base_bundle, name="support", version="3"),
            "wrong-base": write_adapter_bundle(support, tmp / "support-x", another_base, name="support",
                                               version="x")}


def _register(bundle: Path, tracking_uri: str, tmp: Path) -> str:
    """As the pipeline's release stage does: registered against the base, its offline gates passed."""
    from artifacts.adapter_registry import register_adapter_bundle

    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        ref = register_adapter_bundle(bundle, ADAPTER_MODEL, base_model=MODEL, tracking_uri=tracking_uri)
    finally:
        os.chdir(cwd)
    MlflowClient(tracking_uri).set_model_version_tag(ADAPTER_MODEL, ref.version, "lifecycle.gates_passed", "true")
    return ref.version


def test_an_adapter_is_deployed_into_the_base_fleet_rolled_out_promoted_and_rolled_back(tmp_path, micro_base_dir):
    registry = register_versions(tmp_path, {"a": micro_base_dir, "a2": micro_base_dir}, champion=False)
    bundles = _adapter_bundles(tmp_path, micro_base_dir, registry.bundles["a"])
    home, fleet_dir = tmp_path / "home", tmp_path / "fleet"
    common = ["--fleet", str(fleet_dir), "--tracking-uri", registry.tracking_uri]
    serve = ["--threads", "1", "--kv-memory", "16MiB"]
    plan, held = tmp_path / "plan.yaml", tmp_path / "held.yaml"
    plan.write_text(yaml.safe_dump(fast_plan(steps=[CanaryStep(50, seconds=4, min_requests=8, min_keys=5)]
                                             ).to_json()))
    # waits for a person after its step, so the rollback below is a person's, whatever the step decided
    held.write_text(yaml.safe_dump(fast_plan(steps=[CanaryStep(50, seconds=4, min_requests=8, min_keys=5)],
                                             promotion_approval="required").to_json()))
    try:
        early = deploy("snapshot", str(bundles["v1"]), *common, home=home)
        assert early.returncode == 2 and "deploy the base first" in early.stderr and early.stderr.count("\n") == 1
        base = deploy("snapshot", f"models:/{MODEL}/1", *common, *serve, "--max-loras", "2", home=home)
        assert base.returncode == 0, base.stderr[-3000:]
        gateway_url = _record(fleet_dir)["gateway_url"]
        user = {"authorization": f"Bearer {(fleet_dir / 'traffic.key').read_text().strip()}"}

        first = deploy("snapshot", str(bundles["v1"]), *common, home=home)
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        assert f"registered {bundles['v1']} as models:/{ADAPTER_MODEL}/1" in first.stdout
        assert "support-adapter v1 is champion (first champion of the adapter); smoke check passed" in first.stdout
        answer = httpx.post(f"{gateway_url}/v1/chat/completions", headers=user, timeout=60, json={
            "model": "support", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6})
        assert answer.status_code == 200 and answer.json()["model"] == "support", answer.text
        client = MlflowClient(registry.tracking_uri)
        v1 = client.get_model_version(ADAPTER_MODEL, "1")
        assert v1.tags["base_version"] == "1" and v1.aliases == ["champion"]

        wrong = deploy("snapshot", str(bundles["wrong-base"]), *common, home=home)
        assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
        assert "register the base first" in wrong.stderr  # its base is not a version of micro at all

        v2, v3 = _register(bundles["v2"], registry.tracking_uri, tmp_path), \
            _register(bundles["v3"], registry.tracking_uri, tmp_path)
        traffic = TrafficGenerator(gateway_url, user["authorization"].split()[1],
                                   TrafficSpec(concurrency=3, max_tokens=12), model="support").start()
        try:
            rolled = deploy("snapshot", f"models:/{ADAPTER_MODEL}/{v2}", *common, "--plan", str(plan), "--wait",
                            home=home)
            assert rolled.returncode == 0, rolled.stdout[-3000:] + rolled.stderr[-2000:]
            assert f"loaded support@{v2} into the champion's replica v1" in rolled.stdout
            assert "rollout promoted" in rolled.stdout
            status = json.loads(deploy("status", *common, "--json", home=home).stdout)
            assert status["adapter_rollouts"]["support"]["phase"] == "promoted"
            assert [(r["adapter"], r["variant"], r["version"]) for r in status["adapters"]] == [
                ("support", "champion", v2)]
            assert status["variants"][0]["version"] == "1"  # the base was not touched

            started = deploy("snapshot", f"models:/{ADAPTER_MODEL}/{v3}", *common, "--plan", str(held), "--as",
                             "canary", home=home)
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
            again = deploy("snapshot", f"models:/{ADAPTER_MODEL}/{v3}", *common, home=home)
            assert again.returncode == 2 and "is in progress" in again.stderr
            rollback = deploy("rollback", *common, "--adapter", "support", home=home)
            assert rollback.returncode == 0, rollback.stderr[-2000:]
            done = _wait_phase(Path(_record(fleet_dir)["adapter_rollouts"]["support"]), {"rolled_back", "promoted"})
        finally:
            stats = traffic.stop()
        assert done.phase == "rolled_back" and "rollback" in done.reason
        assert stats.user_errors == 0 and stats.sent > 20
        assert str(client.get_model_version_by_alias(ADAPTER_MODEL, "champion").version) == v2
        replica = _record(fleet_dir)["replicas"][0]["url"]
        deadline = time.monotonic() + 60  # the controller's flow unloads the losers once the rollouts end
        while time.monotonic() < deadline:
            served = {m["id"] for m in httpx.get(f"{replica}/v1/models").json()["data"]}
            if "support@1" not in served and f"support@{v3}" not in served:
                break
            time.sleep(0.5)
        assert f"support@{v2}" in served and "support@1" not in served and f"support@{v3}" not in served, served
        # a new base serves none of the old one's adapters: its install says so before it happens
        upgrade = deploy("snapshot", f"models:/{MODEL}/2", *common, *serve, "--max-loras", "2", "--as", "champion",
                         home=home)
        assert upgrade.returncode == 0, upgrade.stderr[-2000:]
        assert "warning: the adapters support run on the current champion's replicas; v2 will not serve them" \
            in upgrade.stdout
    finally:
        stop = deploy("stop", *common, home=home)
        assert stop.returncode == 0, stop.stderr
