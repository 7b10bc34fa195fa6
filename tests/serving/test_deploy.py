"""`deploy snapshot`: registry URI → download → verify → serve, and refusal of a tampered snapshot."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

DEPLOY = [sys.executable, "-m", "serving.deploy"]


@pytest.fixture()
def registered(micro_base_dir: Path, tmp_path: Path) -> tuple[str, Path]:
    """The micro model bundled and registered as `micro@champion` in a fresh sqlite MLflow store."""
    from artifacts.manifest import Lineage
    from artifacts.registry import register_bundle
    from artifacts.writer import BundleConfig, write_bundle

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    bundle = write_bundle(micro_base_dir, tmp_path / "bundle", BundleConfig(name="micro", max_shard_size="100KB"),
                          Lineage(base_model="embedded:micro"))
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the run's default artifact root (./mlruns) lands in the temp dir
    try:
        register_bundle(bundle, "micro", tracking_uri=tracking_uri, aliases=("champion",))
    finally:
        os.chdir(cwd)
    return tracking_uri, bundle


def deploy(*args: str, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | {"LIFECYCLE_HOME": str(cwd / "home")}
    return subprocess.run([*DEPLOY, "snapshot", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env, **kwargs)


def test_dry_run_resolves_alias_and_verifies(registered, tmp_path: Path) -> None:
    tracking_uri, _ = registered
    result = deploy("models:/micro@champion", "--tracking-uri", tracking_uri, "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("verified micro ")
    downloaded = list((tmp_path / "home" / "deployments" / "micro").iterdir())
    assert len(downloaded) == 1 and (downloaded[0] / "manifest.json").is_file()


def test_tampered_bundle_is_refused_with_one_line(registered, tmp_path: Path) -> None:
    _, bundle = registered
    shard = sorted(bundle.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = deploy(str(bundle), "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and shard.name in lines[0]


def test_unknown_alias_and_bad_source_are_one_line(registered, tmp_path: Path) -> None:
    tracking_uri, _ = registered
    missing = deploy("models:/micro@nope", "--tracking-uri", tracking_uri, "--dry-run", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "nope" in missing.stderr
    bad = deploy(str(tmp_path / "absent"), "--dry-run", cwd=tmp_path)
    assert bad.returncode == 2 and "neither a bundle directory nor a models:/ URI" in bad.stderr


@pytest.mark.slow
def test_deploy_serves_the_registered_snapshot_and_tags_it(registered, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    tracking_uri, _ = registered
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = os.environ | {"LIFECYCLE_HOME": str(tmp_path / "home")}
    server = subprocess.Popen([*DEPLOY, "snapshot", "models:/micro@champion", "--standalone",
                               "--tracking-uri", tracking_uri, "--port", str(port), "--kv-memory", "16MiB",
                               "--threads", "1"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("server never became ready")
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "micro", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 8})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        version = MlflowClient(tracking_uri=tracking_uri).get_model_version_by_alias("micro", "champion")
        assert version.tags["lifecycle.deployed_endpoint"] == f"http://127.0.0.1:{port}"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    assert server.returncode == 0


def test_serve_flags_beyond_the_fleets_own_go_on_to_the_snapshots_replica(tmp_path: Path) -> None:
    from serving.deploy import build_parser, replica_serve_flags

    parser = build_parser()
    owned = ["--threads", "1", "--kv-memory", "16MiB", "--port", "9", "--log-level", "debug"]
    assert replica_serve_flags(parser.parse_args(["snapshot", "B", *owned])) == []
    args = parser.parse_args(["snapshot", "B", *owned, "--speculative-tokens", "4", "--speculative-model", "draft",
                              "--max-num-batched-tokens", "1024", "--no-prefix-caching", "--no-engine-process"])
    assert replica_serve_flags(args) == [
        "--max-num-batched-tokens", "1024", "--no-prefix-caching", "--speculative-tokens", "4",
        "--speculative-model", str(Path("draft").resolve()), "--no-engine-process"]
    args = parser.parse_args(["snapshot", "B", "--lora-modules", "support=adapters/s", "sales=/a/sales",
                              "--max-loras", "2", "--admin-key-file", "admin.key"])
    assert replica_serve_flags(args) == [
        "--lora-modules", f"support={Path('adapters/s').resolve()}", "sales=/a/sales", "--max-loras", "2",
        "--admin-key-file", str(Path("admin.key").resolve())]


@pytest.fixture()
def failed_release(micro_base_dir: Path, tmp_path: Path) -> tuple[str, Path]:
    """The micro model bundled with an eval record whose refusal gate failed, registered as the pipeline's
    release stage registers it (version 1, no alias, `lifecycle.gates_passed` = false)."""
    from mlflow import MlflowClient

    from artifacts.eval_record import write_eval_record
    from artifacts.manifest import Lineage
    from artifacts.registry import register_bundle
    from artifacts.writer import BundleConfig, write_bundle

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    bundle = write_bundle(micro_base_dir, tmp_path / "bundle", BundleConfig(name="micro", max_shard_size="100KB"),
                          Lineage(base_model="embedded:micro"))
    record = write_eval_record(bundle, metrics={"refusal_rate": 0.837}, passed=False, gates={
        "format_adherence >= 0.95": {"measured": 1.0, "passed": True, "reason": "format_adherence 1.000 >= 0.95"},
        "refusal_rate >= 0.9": {"measured": 0.837, "passed": False, "reason": "refusal_rate 0.837 < 0.9"}})
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        ref = register_bundle(bundle, "micro", tracking_uri=tracking_uri)
    finally:
        os.chdir(cwd)
    client = MlflowClient(tracking_uri)
    client.log_artifact(client.get_model_version("micro", ref.version).run_id, str(record))  # as the release stage
    client.set_model_version_tag("micro", ref.version, "lifecycle.gates_passed", "false")
    client.set_model_version_tag("micro", ref.version, "lifecycle.gates", "1/2 passed")
    return tracking_uri, bundle


@pytest.mark.slow
def test_a_release_that_failed_its_gates_is_installed_only_when_waived(failed_release, tmp_path: Path) -> None:
    """The first champion used to be installed after a smoke check whatever its release gates said."""
    from mlflow import MlflowClient

    from tests.serving.fleet_support import deploy as deploy_cli

    tracking_uri, _ = failed_release
    fleet = tmp_path / "fleet"
    common = ["--fleet", str(fleet), "--tracking-uri", tracking_uri]
    serve = ["--threads", "1", "--kv-memory", "16MiB"]
    home = tmp_path / "home"
    refused = deploy_cli("snapshot", "models:/micro/1", *common, *serve, home=home)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("error:")]  # beside the download's bar
    assert line.startswith("error: v1 failed its release gates (refusal_rate >= 0.9 (refusal_rate 0.837 < 0.9);")
    assert "--waive eval_record" in line and "format_adherence" not in line
    assert not (fleet / "fleet.json").exists()  # nothing was started

    other = deploy_cli("snapshot", "models:/micro/1", *common, *serve, "--waive", "probe_accuracy", home=home)
    assert other.returncode == 2 and "only eval_record applies" in other.stderr, other.stderr

    try:
        installed = deploy_cli("snapshot", "models:/micro/1", *common, *serve, "--waive", "eval_record", home=home)
        assert installed.returncode == 0, installed.stdout + installed.stderr
        assert "installing it anyway: eval_record waived by" in installed.stdout
        assert "v1 is champion (first champion" in installed.stdout and "failed release gates waived by" \
            in installed.stdout
        version = MlflowClient(tracking_uri).get_model_version_by_alias("micro", "champion")
        assert str(version.version) == "1" and version.tags["rollout.waived"].startswith("eval_record by ")
    finally:
        deploy_cli("stop", *common, home=home)


def test_a_snapshot_without_an_eval_record_is_installed_with_a_warning(capsys) -> None:
    from serving.deploy.release_gates import ReleaseVerdict, check_install

    assert check_install(ReleaseVerdict(None), "3", [], console=None, actor="me") == ""
    assert capsys.readouterr().out.startswith("warning: v3 has no eval record")
    assert check_install(ReleaseVerdict(True), "3", [], console=None, actor="me") == ""
