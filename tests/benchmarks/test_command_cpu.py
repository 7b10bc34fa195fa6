"""benchmarks/command_cpu.py counts the CPU of processes the command does not wait for: what `/usr/bin/time` misses."""

from __future__ import annotations

import sys
import textwrap

import pytest

from benchmarks.command_cpu import main, measure

# a fixed amount of work (not a time): its CPU seconds do not depend on how busy the host is
WORK = "n = 0\nfor i in range(12_000_000): n += i"


def test_a_grandchild_left_running_is_counted_and_an_exit_status_kept():
    leaves_a_worker = textwrap.dedent(f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", {WORK!r}])  # not waited for: it outlives this process
        sys.exit(3)
    """)
    code, _, cpu_with_worker, processes = measure([sys.executable, "-c", leaves_a_worker])
    _, _, cpu_alone, _ = measure([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert code == 3 and processes >= 2
    assert cpu_with_worker > cpu_alone + 0.3, (cpu_with_worker, cpu_alone)


def test_a_command_that_cannot_start_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--", "/nonexistent/command"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("/nonexistent/command: No such file or directory")
