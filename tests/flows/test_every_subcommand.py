"""Every `lifecycle` and `deploy` subcommand, run through the installed console script, answers a bad
argument with one `error: ...` line and exit status 2 (its handler ran and refused; no traceback).

The subcommands are read from the parsers, so a new one without a case here fails the test.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from flows.cli import build_parser as build_lifecycle_parser
from serving.deploy import build_parser as build_deploy_parser

BIN = Path(sys.executable).parent
LIFECYCLE = BIN / "lifecycle"
DEPLOY = BIN / "deploy"
TIMEOUT_S = 90  # per command; a command that hangs is a failure, and its process group is killed


@dataclass
class Case:
    args: list[str]  # after the subcommand path
    expected: str  # text the one error line must contain
    env: dict[str, str] = field(default_factory=dict)


def leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every runnable subcommand path, e.g. ('bundle', 'verify'); nested subparsers are followed."""
    leaves: set[tuple[str, ...]] = set()
    subactions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subactions:
        return {prefix}
    for action in subactions:
        for name, sub in action.choices.items():
            leaves |= leaf_commands(sub, (*prefix, name))
    return leaves


def lifecycle_cases(tmp: Path) -> dict[tuple[str, ...], Case]:
    """Subcommand path -> a bad invocation that its handler (not argparse) must refuse."""
    nope = str(tmp / "nope")
    not_keys = tmp / "not-keys.yaml"
    not_keys.write_text("garbage: [\n")
    return {
        ("run",): Case([f"{nope}.yaml"], "no such config file"),
        ("ui",): Case(["--recipe", f"{nope}.yaml"], "no such config file"),
        ("bundle", "verify"): Case([nope], "not a directory"),
        ("bundle", "write"): Case([nope, str(tmp / "out"), "--name", "x"], "not a directory"),
        ("bundle", "write-adapter"): Case([nope, str(tmp / "adapter-out"), "--base", nope, "--name", "x"],
                                          "not a directory"),
        ("bundle", "register"): Case([nope, "--model-name", "x", "--tracking-uri", f"file:{tmp / 'mlruns'}"],
                                     "not a directory"),
        ("bundle", "resolve"): Case(["not-a-uri", "--dest", str(tmp / "dest")], "not-a-uri"),
        ("eval",): Case([nope, nope], "model dir not found"),
        ("quantize",): Case(["--model", nope, "--data", nope, "--out", str(tmp / "q")], "config.json: not found"),
        ("serve",): Case([nope], "not a directory"),
        ("draft", "build"): Case(["--target", nope, "--out", str(tmp / "draft")], "no such directory"),
        ("gateway",): Case([f"{nope}.yaml"], "no such config file"),
        ("gateway-keys", "add"): Case(["k", "--keys-file", str(not_keys)], "not a keys file"),
        ("gateway-keys", "list"): Case(["--keys-file", f"{nope}.yaml"], "keys file not found"),
        ("gateway-keys", "revoke"): Case(["k", "--keys-file", f"{nope}.yaml"], "keys file not found"),
        ("rollout", "run"): Case([nope], "cannot read the rollout state"),
        ("schedule",): Case([f"{nope}.yaml", "--cron", "0 3 * * *"], "no such config file"),
        # nothing listens on the discard port: the worker's first call to the server fails
        ("worker",): Case([], "Prefect server at http://127.0.0.1:9/api",
                          env={"PREFECT_API_URL": "http://127.0.0.1:9/api"}),
        ("server",): Case(["--port", "70000"], "--port"),
    }


def deploy_cases(tmp: Path) -> dict[tuple[str, ...], Case]:
    nope = str(tmp / "nope")
    no_fleet = ["--fleet", nope]
    cases = {
        ("snapshot",): Case([nope, "--fleet", str(tmp / "fleet"), "--tracking-uri", f"file:{tmp / 'mlruns'}",
                             "--dry-run"], "neither a bundle directory nor a models:/ URI"),
        ("status",): Case(no_fleet, "no fleet here"),
        ("stop",): Case(no_fleet, "no fleet here"),
    }
    for action in ("promote", "rollback", "pause", "resume"):
        cases[(action,)] = Case([*no_fleet, "--wait", "0"], "no fleet here")
    return cases


def run_command(command: list[str], env: dict[str, str], cwd: Path) -> tuple[int | None, str]:
    """(exit status or None on timeout, stderr); on a timeout the command's whole process group is killed."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return None, stderr
    return proc.returncode, stderr


def test_every_subcommand_answers_a_bad_argument_with_one_error_line_and_exit_2(tmp_path: Path) -> None:
    assert LIFECYCLE.is_file() and DEPLOY.is_file(), f"no console scripts in {BIN}: pip install -e . first"
    lifecycle = lifecycle_cases(tmp_path)
    deploy = deploy_cases(tmp_path)
    # A subcommand added to a parser without a case here (or a case for one that is gone) fails first.
    assert set(lifecycle) == leaf_commands(build_lifecycle_parser())
    assert set(deploy) == leaf_commands(build_deploy_parser())

    runs = [([str(LIFECYCLE), *path, *case.args], case) for path, case in sorted(lifecycle.items())]
    runs += [([str(DEPLOY), *path, *case.args], case) for path, case in sorted(deploy.items())]
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("MLFLOW_TRACKING_URI", "LIFECYCLE_HOME", "PREFECT_API_URL", "PREFECT_HOME")}
    base_env["LIFECYCLE_HOME"] = str(tmp_path / "home")

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda run: run_command(run[0], base_env | run[1].env, tmp_path), runs))

    failures = []
    for (command, case), (status, stderr) in zip(runs, results, strict=True):
        lines = stderr.strip().splitlines()
        if not (status == 2 and len(lines) == 1 and lines[0].startswith("error: ") and case.expected in lines[0]):
            shown = " ".join(Path(command[0]).name if i == 0 else a for i, a in enumerate(command))
            failures.append(f"{shown}: exit {status if status is not None else 'timeout'}, stderr {stderr[-600:]!r}")
    assert not failures, "\n".join(failures)


def test_building_the_parser_does_not_import_torch() -> None:
    code = "import sys; from flows.cli import build_parser; build_parser(); sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr or "building the lifecycle parser imported torch"


def test_lifecycle_help_works_without_torch() -> None:
    code = ("import sys\nfrom flows.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nsys.exit(3 if 'torch' in sys.modules else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr or "lifecycle --help imported torch"
    assert "quantize" in result.stdout and "serve" in result.stdout
    script = subprocess.run([str(LIFECYCLE), "--help"], capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and "usage: lifecycle" in script.stdout, script.stderr
