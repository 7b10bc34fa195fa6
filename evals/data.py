"""Reading the data stage's held-out JSONL files, checked record by record.

Why strict: an eval over a silently malformed file reports a wrong number that then gates a promotion;
a bad line should stop the run with the file, line and field named instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from artifacts.jsonl import iter_jsonl
from evals.errors import EvalError

TASKS_FILE = "tasks_heldout.jsonl"
SAFETY_FILE = "safety_heldout.jsonl"
TEXT_FILE = "text_heldout.jsonl"
PREF_FILE = "pref_heldout.jsonl"

Record = dict[str, Any]


def read_jsonl(path: Path, required: dict[str, type | tuple[type, ...]],
               check: Callable[[Record], str | None] | None = None) -> list[Record]:
    """All records of ``path``; each must be a JSON object holding ``required`` fields of the given types
    and pass ``check`` (which returns a reason string for a bad record, None for a good one)."""
    records: list[Record] = []
    for lineno, record in iter_jsonl(path, EvalError, "data file not found (is the data dir the data stage's output?)"):
        for name, kind in required.items():
            if name not in record:
                raise EvalError(f"{path}:{lineno}: missing field {name!r}")
            if not isinstance(record[name], kind):
                raise EvalError(f"{path}:{lineno}: field {name!r} has the wrong type "
                                f"({type(record[name]).__name__})")
        reason = check(record) if check else None
        if reason:
            raise EvalError(f"{path}:{lineno}: {reason}")
        records.append(record)
    if not records:
        raise EvalError(f"{path}: no records")
    return records


def messages_problem(record: Record, *fields: str) -> str | None:
    """Why one of ``fields`` is not a non-empty list of ``{"role", "content"}`` dicts (TRL's
    conversational format), or None if all are."""
    for name in fields:
        value = record.get(name)
        ok = isinstance(value, list) and bool(value) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
        if not ok:
            return f"field {name!r} must be a non-empty list of {{'role': str, 'content': str}} messages"
    return None


def take_stratified(records: list[Record], limit: int | None, key: Callable[[Record], str]) -> list[Record]:
    """At most ``limit`` records, drawn round-robin across strata in file order.

    Why not the first ``limit`` lines: held-out files are often grouped by task, so a prefix would
    evaluate one task only and the per-slice numbers (and gates on them) would vanish.
    """
    if limit is None or limit >= len(records):
        return list(records)
    groups: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        groups[key(record)].append(record)
    queues = [iter(g) for g in groups.values()]
    out: list[Record] = []
    while len(out) < limit:
        for queue in queues:
            item = next(queue, None)
            if item is not None:
                out.append(item)
                if len(out) == limit:
                    break
    return out
