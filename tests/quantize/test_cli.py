import argparse

import pytest

from quantize.cli import config_from_args, main, register_cli


def _parse(argv):
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_flags_map_to_config(tmp_path):
    args = _parse(["quantize", "--model", "m", "--data", "d", "--out", "o", "--methods", "gptq", "--group-size", "64",
                   "--no-gate"])
    cfg = config_from_args(args)
    assert cfg.methods == ["gptq"] and cfg.group_size == 64 and cfg.gate_gptq_beats_rtn is False


def test_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["quantize", "--model", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--bits", "5"]) == 2
    assert capsys.readouterr().err.startswith("error: quantize options: bits:")
    assert main(["quantize", "--model", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "config.json: not found" in capsys.readouterr().err


def test_help_lists_options(capsys):
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "--calibration-file" in capsys.readouterr().out
