"""Write a file so a reader sees the old content or the new one, never half of either.

Why: a crash (or kill -9) during a plain write leaves a truncated file that a restart would trust;
writing beside the target and renaming is atomic on POSIX, and fsync first makes it survive power loss.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` through a temporary sibling and one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str, *, mode: int | None = None) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: str | Path, payload: Any, *, mode: int | None = None) -> Path:
    return atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n", mode=mode)
