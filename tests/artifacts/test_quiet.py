"""Third-party output goes to a log file, not the terminal, and nothing is lost."""

from __future__ import annotations

import os
import sys

from artifacts.common.quiet import output_to_log


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
