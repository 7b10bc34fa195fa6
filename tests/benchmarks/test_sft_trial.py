"""benchmarks/sft_trial.py: one SFT run on data built with a key changed, and the line it prints."""

from __future__ import annotations

from pathlib import Path

from benchmarks.sft_trial import SHOWN, main
from flows.recipe import load_recipe
from training.data import read_jsonl

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"


def test_a_trial_builds_the_changed_data_trains_and_prints_every_number(micro_base_dir, tmp_path, capsys):
    assert main([str(SMOKE), str(micro_base_dir), str(tmp_path / "t"), "--data", "sft_json_per_task=3",
                 "--set", "max_steps=2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("sft_json_per_task=3 max_steps=2: SFT ")
    assert all(f"{metric} " in line for metric in SHOWN)
    asked_json = [r for r in read_jsonl(tmp_path / "t" / "data" / "sft_train.jsonl")
                  if "Reply with JSON only" in r["messages"][0]["content"]]
    assert len(asked_json) == 3 * len(load_recipe(SMOKE).data.tasks)  # the changed key reached the data
    assert (tmp_path / "t" / "sft" / "stage_result.json").is_file()


def test_a_bad_key_or_model_is_one_line_and_writes_nothing(micro_base_dir, tmp_path, capsys):
    assert main([str(SMOKE), str(micro_base_dir), str(tmp_path / "a"), "--data", "bogus=1"]) == 2
    assert main([str(SMOKE), str(tmp_path / "no-model"), str(tmp_path / "b")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0].startswith("error: ") and "bogus" in errors[0]
    assert errors[1] == f"error: {tmp_path / 'no-model'}: not a model directory (no config.json)"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
