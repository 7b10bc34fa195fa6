"""How long `lifecycle serve` takes to answer /ready, and what its processes spend getting there.

A replica's start is paid by every rollout (candidate and baseline replicas), every `deploy snapshot`, every
restart after a crash, and many times over by the test suite. This starts ``python -m serving.cli serve MODEL``
(the engine in its own process, the default) from this checkout and, with ``--tree NAME=PATH``, from other
checkouts of the repository (``git worktree add /tmp/before REV``), taking turns for ``--rounds`` rounds so the
host's other load falls on every tree alike; each start ends with SIGTERM once /ready answers 200. The table gives
the median seconds to ready and the CPU seconds the server's processes used (the API process and its engine core,
read from /proc just before the stop), and each tree's ratio to the first.

    .venv/bin/python benchmarks/serve_start.py --model DIR --tree before=/tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

import psutil  # noqa: E402

from artifacts.common.net import answers_200, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def start_once(tree: Path, model: Path, timeout: float = 300.0) -> tuple[float, float]:
    """Seconds until /ready answers, and CPU seconds of the server and its children by then."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", str(model), "--port", str(port),
                             "--threads", "1"], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not answers_200(f"http://127.0.0.1:{port}/ready", timeout=1.0):
            if proc.poll() is not None:
                raise SystemExit(f"{tree}: the server exited with {proc.returncode} before it was ready")
            if time.monotonic() - began > timeout:
                raise SystemExit(f"{tree}: not ready after {timeout:.0f} s")
            time.sleep(0.05)
        ready = time.monotonic() - began
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        cpu = sum(p.cpu_times().user + p.cpu_times().system for p in family if p.is_running())
        return ready, cpu
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path, help="a model directory or bundle")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="another checkout to start beside this one (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    trees = {"this": REPO}
    for item in args.tree:
        name, _, path = item.partition("=")
        if not path or not (Path(path) / "serving" / "cli.py").is_file():
            ap.error(f"--tree {item}: expected NAME=PATH of a checkout of this repository")
        trees[name] = Path(path).resolve()
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees)[r % len(trees):] + list(trees)[:r % len(trees)]
        for name in order:
            seen[name].append(start_once(trees[name], args.model))
            print(f"round {r + 1}: {name} ready in {seen[name][-1][0]:.1f} s, {seen[name][-1][1]:.1f} CPU s",
                  file=sys.stderr, flush=True)
    first = next(iter(trees))
    base_ready = statistics.median(s[0] for s in seen[first])
    base_cpu = statistics.median(s[1] for s in seen[first])
    print(f"| tree | ready (s, median of {args.rounds}) | CPU s | ready / {first} | CPU / {first} |")
    print("|---|---:|---:|---:|---:|")
    for name, samples in seen.items():
        ready = statistics.median(s[0] for s in samples)
        cpu = statistics.median(s[1] for s in samples)
        print(f"| {name} | {ready:.1f} | {cpu:.1f} | {ready / base_ready:.2f} | {cpu / base_cpu:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
