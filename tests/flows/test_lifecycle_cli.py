"""`lifecycle run` answers a bad recipe or input with one line and exit 2, before any work starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

LIFECYCLE = [sys.executable, "-m", "flows.cli"]


def run(recipe: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*LIFECYCLE, "run", str(recipe)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={"LIFECYCLE_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: x\ntraining:\n  sft:\n    lora:\n      rank: 8\n",
         "unknown key 'training.sft.lora.rank' (known keys: alpha, dropout, qlora, r, target_modules)"),
        ("name: x\ntraining:\n  grpo:\n    batch_size: 6\n    num_generations: 4\n",
         "training.grpo: batch_size: must be a multiple of num_generations (4), got 6"),
        ("name: x\nquantize:\n  methods: [gptq, fp8]\n", "quantize: methods: unknown method(s) ['fp8']"),
        ("name: x\nevals:\n  suites: [task_accuracy, vibes]\n", "evals: suites: unknown suite 'vibes'"),
        ("name: x\ngates: ['task_accuracy ~ 0.5']\n", "gates: cannot parse 'task_accuracy ~ 0.5'"),
        ("name: x\nbase:\n  source: ./nowhere\n", "base.source: './nowhere' is neither 'embedded' nor a directory"),
        ("name: x\nthreads: two\n", "threads: expected an integer, got 'two'"),
    ],
)
def test_bad_recipe_is_one_line_and_exit_2(tmp_path: Path, text: str, expected: str) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    result = run(recipe, tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {recipe}: "), lines
    assert expected in lines[0]
    assert not (tmp_path / "home").exists()  # nothing was started or written


def test_directory_that_is_not_a_model_fails_before_the_flow(tmp_path: Path) -> None:
    (tmp_path / "not-a-model").mkdir()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\nbase:\n  source: not-a-model\n")
    result = run(recipe, tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: base model {tmp_path / 'not-a-model'}: missing config.json"


def test_local_dataset_without_required_column_is_named(tmp_path: Path) -> None:
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text(json.dumps({"prompt": "2+2?", "chosen": "Answer: 4"}) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: x\ndata:\n  preference_path: {prefs}\n")
    result = run(recipe, tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(prefs) in lines[0] and "rejected" in lines[0]


@pytest.mark.parametrize(("source", "expected"), [
    (None, "cannot load the lifecycle_missing_cli subcommands: ModuleNotFoundError: No module named "
           "'lifecycle_missing_cli'"),
    ("import lifecycle_missing_dependency\n", "cannot load the lifecycle_broken_cli subcommands: "
                                              "ModuleNotFoundError: No module named 'lifecycle_missing_dependency'"),
])
def test_a_subcommand_package_that_cannot_be_imported_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, source: str | None,
        expected: str) -> None:
    """Never a parser that silently lacks the subcommands of a package that failed to import."""
    from flows import cli

    name = "lifecycle_missing_cli" if source is None else "lifecycle_broken_cli"
    if source is not None:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "_SUBCOMMAND_PROVIDERS", ("flows.run_cli", name))
    assert cli.main(["run", "--help"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: {expected}"]
