"""`bundle` subcommands: success prints a summary with the manifest digest; failure is one line, exit 2."""

from __future__ import annotations

import argparse

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
