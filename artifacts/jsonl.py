"""Reading the pipeline's JSONL files with errors that name the file and line.

Every stage reads the data stage's JSONL (and users' own files). One reader keeps the rules the same
everywhere: UTF-8, one JSON object per line, blank lines skipped, and the first bad line reported as
`<path>:<line>: <reason>` through the caller's own error class, so each stage keeps its error type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from artifacts.errors import LifecycleError


def iter_jsonl(path: str | Path, error: type[LifecycleError], missing_hint: str = "file not found"
               ) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield `(line number, record)` for each non-blank line; raise `error` for the first bad one."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: {missing_hint}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines(): JSON may hold U+2028
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise error(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        yield lineno, record
