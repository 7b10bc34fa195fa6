"""`bundle` subcommands: success prints a summary with the manifest digest; failure is one line, exit 2."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from artifacts.cli import main, register_cli
from artifacts.manifest import manifest_digest


def test_subcommands_are_registered():
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bundle", "verify", "/x", "--tp", "2"])
    assert args.dir == "/x" and args.tp == 2 and callable(args.func)
    args = parser.parse_args(["bundle", "register", "/x", "--model-name", "m", "--alias", "a", "--alias", "b"])
    assert args.alias == ["a", "b"]


def test_verify_success_prints_digest(session_bundle, capsys):
    assert main(["bundle", "verify", str(session_bundle)]) == 0
    out = capsys.readouterr().out
    assert manifest_digest(session_bundle) in out and "model-00001-of-" in out


def test_verify_failure_is_one_line(bundle, capsys):
    shard = min(bundle.glob("model-*.safetensors"))
    shard.unlink()
    assert main(["bundle", "verify", str(bundle)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {shard.name}: missing shard (listed in the manifest)"


def test_verify_tp_degree_that_does_not_fit(session_bundle, capsys):
    assert main(["bundle", "verify", str(session_bundle), "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tp degree 3" in err[0]


def test_bundle_planned_beyond_its_kv_heads_verifies_at_that_degree(model_dir, tmp_path, capsys):
    """2 KV heads planned over 1, 2 and 4 ranks: the plan replicates each KV head on 2 of the 4 ranks, and
    `bundle verify --tp 4` accepts it (the writer refused tp 4 before)."""
    from artifacts.manifest import read_manifest

    out = tmp_path / "b"
    assert main(["bundle", "write", str(model_dir), str(out), "--name", "kv2",
                 "--tp", "1", "--tp", "2", "--tp", "4"]) == 0, capsys.readouterr().err
    plans = read_manifest(out).shard_plan.tp
    assert read_manifest(out).architecture.num_kv_heads == 2
    assert {d: p.kv_heads for d, p in plans.items()} == {"1": [[0, 1]], "2": [[0], [1]], "4": [[0], [0], [1], [1]]}
    k_proj = plans["4"].tensors["model.layers.0.self_attn.k_proj.weight"]
    rows = read_manifest(out).shard_plan.tensors["model.layers.0.self_attn.k_proj.weight"].shape[0]
    assert k_proj.ranges == [[0, rows // 2], [0, rows // 2], [rows // 2, rows], [rows // 2, rows]]
    capsys.readouterr()
    assert main(["bundle", "verify", str(out), "--tp", "4"]) == 0, capsys.readouterr().err
    assert "tp degrees 1,2,4" in capsys.readouterr().out


def test_write_then_refuse_overwrite(model_dir, tmp_path, capsys, small_shard_size):
    out = tmp_path / "b"
    argv = ["bundle", "write", str(model_dir), str(out), "--name", "tiny", "--max-shard-size", small_shard_size,
            "--stage-run", "sft=abc", "--tp", "1"]
    assert main(argv) == 0
    assert manifest_digest(out) in capsys.readouterr().out
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["bundle", "write", str(model_dir), str(tmp_path / "c"), "--name", "t", "--stage-run", "x"]) == 2
    assert "--stage-run: expected KEY=VALUE" in capsys.readouterr().err


def test_register_without_tracking_uri_uses_the_pipeline_store(session_bundle, tmp_path):
    """`lifecycle bundle register` with no --tracking-uri and no $MLFLOW_TRACKING_URI writes into the store under
    $LIFECYCLE_HOME (as `deploy` and `lifecycle ui` read it), not a new mlflow.db and mlruns/ where it stands."""
    from mlflow import MlflowClient

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env |= {"LIFECYCLE_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true"}
    done = subprocess.run([str(Path(sys.executable).parent / "lifecycle"), "bundle", "register", str(session_bundle),
                           "--model-name", "tiny-cli"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "registered models:/tiny-cli/1" in done.stdout
    assert sorted(p.name for p in cwd.iterdir()) == []  # no mlflow.db, no mlruns/
    version = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_model_version("tiny-cli", "1")
    assert version.tags["manifest_digest"] == manifest_digest(session_bundle)
    assert (home / "mlartifacts" / "bundles").is_dir()  # the bundle's files sit beside the store
