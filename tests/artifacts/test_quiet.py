"""Third-party output goes to a log file, not the terminal, and nothing is lost."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from artifacts.common.quiet import output_to_log, quiet_if_quantized, quietly


def test_python_and_c_level_output_goes_to_the_log_and_the_terminal_comes_back(tmp_path, capfd):
    log = tmp_path / "lib.log"
    with output_to_log(log, "noisy library"):
        print("banner from python")
        sys.stderr.write("a table on stderr\n")
        os.write(1, b"written by C code\n")
    print("after")
    out, err = capfd.readouterr()
    text = log.read_text()
    assert "banner from python" in text and "a table on stderr" in text and "written by C code" in text
    assert "banner" not in out and "table" not in err and "C code" not in out
    assert out == "after\n"
    assert "noisy library" in err and str(log) in err  # the one line the user sees


def test_a_log_handler_a_library_sets_up_meanwhile_writes_to_stderr_afterwards(tmp_path, capfd):
    """gptqmodel's imports give the `datasets` logger a stream handler on whatever stderr is then: the
    temporary log, closed after the block. Records through it must still print, not "Logging error"."""
    lib = logging.getLogger("a_noisy_library_under_test")
    with output_to_log(tmp_path / "lib.log", "noisy library"):
        handler = logging.StreamHandler()  # bound to sys.stderr as it is now
        lib.addHandler(handler)
    try:
        lib.warning("said after loading")
        _, err = capfd.readouterr()
        assert "said after loading" in err and "Logging error" not in err
    finally:
        lib.removeHandler(handler)


def test_quietly_says_nothing_of_its_own_and_lets_failures_through(tmp_path, capfd):
    with quietly():
        print("banner from python")
        os.write(2, b"INFO  Kernel: selected by C code\n")
    with pytest.raises(ValueError, match="bad checkpoint"), quietly(tmp_path / "lib.log"):
        print("kept in the log")
        raise ValueError("bad checkpoint")
    print("after")
    out, err = capfd.readouterr()
    assert out == "after\n" and err == ""
    assert "kept in the log" in (tmp_path / "lib.log").read_text()


def test_quiet_if_quantized_silences_only_a_quantized_checkpoint(tmp_path, capfd):
    plain, quantized = tmp_path / "plain", tmp_path / "gptq"
    for path, config in ((plain, {}), (quantized, {"quantization_config": {"quant_method": "gptq"}})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    for path in (plain, quantized):
        with quiet_if_quantized(path):
            print(f"loading {path.name}")
    out, _ = capfd.readouterr()
    assert out == "loading plain\n"
