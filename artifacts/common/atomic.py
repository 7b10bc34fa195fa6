"""Write a file or a directory so a reader sees the old content or the new one, never half of either.

Why: a crash (or kill -9) during a plain write leaves a truncated file that a restart would trust;
writing beside the target and renaming is atomic on POSIX, and fsync first makes it survive power loss.
Every stage that produces a file (markers, records, state) or a directory (a model, a bundle, a dataset)
writes it through here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal


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


def atomic_write_json(path: str | Path, payload: Any, *, mode: int | None = None, sort_keys: bool = True) -> Path:
    text = json.dumps(payload, indent=2, sort_keys=sort_keys, default=str) + "\n"
    return atomic_write_text(path, text, mode=mode)


ExistingTarget = Literal["replace", "keep", "fail", "merge"]


@contextlib.contextmanager
def staged_directory(target: str | Path, if_exists: ExistingTarget = "replace") -> Iterator[Path]:
    """Yield an empty directory beside ``target``; publish it as ``target`` when the block succeeds.

    A crash or an error inside the block removes the staging directory, so nothing half-written is ever
    found under the target's name. What happens when ``target`` already exists when the block ends:

    - ``replace``: the old one is renamed aside, the new one renamed in, the old one removed;
    - ``keep``: someone else finished first (two runs building the same cached thing); theirs stays;
    - ``fail``: FileExistsError, the new content is discarded;
    - ``merge``: each top-level entry is renamed into ``target``, replacing entries of the same name
      (for a directory that holds other outputs too; its own completion marker says when it is whole).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; the published dir should read like any other
    try:
        yield staging
        _publish(staging, target, if_exists)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, target: Path, if_exists: ExistingTarget) -> None:
    if if_exists == "merge" and target.is_dir():
        for item in staging.iterdir():
            destination = target / item.name
            if destination.is_dir() and not destination.is_symlink():
                shutil.rmtree(destination)
            os.replace(item, destination)
        return
    try:
        os.rename(staging, target)  # atomic; also replaces an empty directory on POSIX
        return
    except OSError:  # a non-empty target (or one that appeared meanwhile): the policy decides
        if not target.exists():
            raise
    if if_exists == "keep":
        return
    if if_exists == "fail":
        raise FileExistsError(f"{target}: appeared while it was being written; not replacing it")
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(target, old)
    os.rename(staging, target)
    shutil.rmtree(old, ignore_errors=True)
