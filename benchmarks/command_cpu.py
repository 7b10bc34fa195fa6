"""`python benchmarks/command_cpu.py [--label NAME] -- CMD ...`: run a command and print its wall time and the CPU time
of every process it started, children, grandchildren and daemons included.

Why not `/usr/bin/time`: it counts only the children the command waited for. A pipeline's training workers, its
Prefect server and a fork server's workers are not all reaped by the process `time` watches, and on a 2-core host
the CPU they use is what makes everything else slower. Linux only: the command runs in a session of its own, and
psutil reads the CPU of that session's processes every half second (one shorter than that may be missed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time


def _session_cpu(session: int) -> dict[int, float]:
    """CPU seconds (user + system) of every live process of `session`, by pid."""
    import psutil

    seen = {}
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session:
                times = proc.cpu_times()
                seen[proc.pid] = times.user + times.system
        except (OSError, psutil.Error):
            continue  # gone between the listing and the read
    return seen


def measure(command: list[str]) -> tuple[int, float, float, int]:
    """(exit status, wall seconds, CPU seconds, processes seen) of `command`."""
    start = time.monotonic()
    proc = subprocess.Popen(command, start_new_session=True)
    cpu: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            cpu.update(_session_cpu(proc.pid))
            done.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = proc.wait()
    wall = time.monotonic() - start
    while _session_cpu(proc.pid):  # what the command left running (a daemon) is counted until it ends
        time.sleep(0.5)
    done.set()
    sampler.join()
    return code, wall, sum(cpu.values()), len(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="command")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    try:
        code, wall, cpu, processes = measure(command)
    except OSError as exc:  # not found, not executable: one line, not a traceback
        parser.error(f"{command[0]}: {exc.strerror}")
    print(f"| {args.label} | exit {code} | wall {wall:.1f} s | CPU {cpu:.1f} s | {processes} processes |",
          file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
