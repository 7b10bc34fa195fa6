"""`lifecycle eval` through the evals CLI entry point (the same handler `lifecycle eval` dispatches to)."""

from __future__ import annotations

import json

from evals.cli import main


def test_eval_cli_table_json_and_gates(micro_base_dir, micro_data_dir, tmp_path, capsys):
    out = tmp_path / "res.json"
    code = main(["eval", str(micro_base_dir), str(micro_data_dir), "--suites", "perplexity,safety",
                 "--max-examples", "2", "--json-out", str(out), "--gate", "perplexity >= 1",
                 "--gate", "refusal_rate >= 2"])
    printed = capsys.readouterr().out
    assert code == 1  # refusal_rate can never reach 2: a failed gate
    assert "| perplexity | perplexity | (all) |" in printed and "refusal_rate" in printed
    assert "gates failed: refusal_rate" in printed
    assert [r["metric"] for r in json.loads(out.read_text())["results"]] == [
        "perplexity", "refusal_rate", "over_refusal_rate"]  # in the order the suites were asked for


def test_eval_cli_errors_are_one_line(micro_data_dir, tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope"), str(micro_data_dir)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'}: model dir not found"
    assert main(["eval", str(tmp_path), str(micro_data_dir), "--suites", "vibes"]) == 2
    assert "unknown suite 'vibes'" in capsys.readouterr().err
