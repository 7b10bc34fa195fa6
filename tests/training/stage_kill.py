"""What the resume tests do to a stage: run it in a child process, SIGKILL that process once a checkpoint is on
disk, and say which step the newest complete checkpoint holds. Not a test module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from training.checkpoints import latest_checkpoint


def kill_at_first_checkpoint(script: str, args: list[str], out: Path, tmp_path: Path, timeout: float = 300,
                             before_kill: Callable[[int], None] | None = None) -> int:
    """Run ``script`` (python source; ``sys.argv[1:]`` is ``args`` then this folder, for imports) as a child,
    kill it once ``out/checkpoints`` holds a complete checkpoint (``before_kill(pid)`` runs just before), and return
    the step of the newest complete checkpoint left behind."""
    path = tmp_path / "child.py"
    path.write_text(script)
    child = subprocess.Popen([sys.executable, str(path), *args, str(Path(__file__).parent)],
                             env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while latest_checkpoint(out / "checkpoints") is None:
            assert child.poll() is None, f"stage process exited early with {child.returncode}"
            assert time.monotonic() < deadline, f"no checkpoint within {timeout:.0f} s"
            time.sleep(0.05)
        if before_kill is not None:
            before_kill(child.pid)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    return int(latest_checkpoint(out / "checkpoints").name.rsplit("-", 1)[-1])
