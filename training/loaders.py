"""Load a user's own SFT / preference / GRPO data from local JSONL, JSON or Parquet files, or from a
directory of them that grows over time (every supported file in it, in name order).

Why through `datasets`: it is what TRL consumes, it reads Parquet and JSON Lines alike, and its schema
inference catches malformed files early. Every problem becomes a `DatasetError` naming the file and the
field (or row), so the CLI prints one actionable line instead of a pyarrow traceback. Records come back
normalized to the conversational shapes the data contract uses (plain-string prompts become one user
message, plain-string completions one assistant message).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from artifacts.errors import LifecycleError

KINDS: dict[str, tuple[str, ...]] = {
    "sft": ("messages",),
    "preference": ("prompt", "chosen", "rejected"),
    "grpo": ("prompt", "answer"),
}
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_ROLES = {"system", "user", "assistant"}


class DatasetError(LifecycleError):
    """A dataset file is missing, unreadable, or lacks a field its kind needs."""


def dataset_files(path: str | Path) -> list[Path]:
    """The files a dataset path stands for: itself, or a directory's supported files in name order.

    Hidden files and ``*.tmp``/``*.part`` are skipped, so a file being copied in (write to a temporary name,
    then rename) is never read half-written."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in _BUILDERS
                   and not p.name.startswith("."))
    if not files:
        raise DatasetError(f"{path}: no .jsonl, .json or .parquet files in this directory")
    return files


def load_local_dataset(path: str | Path, kind: str) -> list[dict[str, Any]]:
    """Read ``path`` (a file, or a directory of files) as a dataset of ``kind`` ("sft", "preference" or
    "grpo"), validated and normalized; a bad file fails the whole load, naming that file."""
    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    records: list[dict[str, Any]] = []
    for file in dataset_files(path):
        records += _load_file(file, kind)
    return records


def _load_file(path: Path, kind: str) -> list[dict[str, Any]]:
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(f"{path}: unsupported file type {path.suffix or '(none)'!r} "
                           f"(use .jsonl, .json or .parquet)")
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    rows = _read(path, builder)
    if not rows:
        raise DatasetError(f"{path}: no records")
    columns = set(rows[0])
    for name in KINDS[kind]:
        if name not in columns:
            raise DatasetError(f"{path}: missing field {name!r} (a {kind} dataset needs "
                               f"{', '.join(KINDS[kind])}; found {', '.join(sorted(columns)) or 'none'})")
    return [_normalize(path, kind, i, row) for i, row in enumerate(rows)]


def _read(path: Path, builder: str) -> list[dict[str, Any]]:
    from datasets import load_dataset

    with tempfile.TemporaryDirectory(prefix="lifecycle-ds-") as cache_dir:
        try:
            dataset = load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
        except Exception as exc:  # datasets/pyarrow raise many types; all mean "this file does not parse"
            raise DatasetError(f"{path}: cannot read as {builder} ({_root_reason(exc)})") from None
        return dataset.to_list()


def _root_reason(exc: BaseException) -> str:
    """The innermost cause's first line: datasets wraps the useful pyarrow message in a generic one."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _messages(path: Path, index: int, field: str, value: Any, default_role: str) -> list[dict[str, str]]:
    """A list of {role, content} messages; a bare string becomes one message with ``default_role``."""
    where = f"{path}: record {index} field {field!r}"
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: empty")
        return [{"role": default_role, "content": value}]
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: must be a string or a non-empty list of messages")
    out = []
    for message in value:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DatasetError(f"{where}: every message needs 'role' and 'content'")
        if message["role"] not in _ROLES:
            raise DatasetError(f"{where}: unknown role {message['role']!r}")
        if not isinstance(message["content"], str):
            raise DatasetError(f"{where}: message content must be a string")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def _normalize(path: Path, kind: str, index: int, row: dict[str, Any]) -> dict[str, Any]:
    for name in KINDS[kind]:
        if row.get(name) is None:
            raise DatasetError(f"{path}: record {index} has no value for field {name!r}")
    if kind == "sft":
        messages = _messages(path, index, "messages", row["messages"], "user")
        if messages[-1]["role"] != "assistant":
            raise DatasetError(f"{path}: record {index} field 'messages': the last message must be the "
                               "assistant's")
        return {"messages": messages}
    if kind == "preference":
        return {"prompt": _messages(path, index, "prompt", row["prompt"], "user"),
                "chosen": _messages(path, index, "chosen", row["chosen"], "assistant"),
                "rejected": _messages(path, index, "rejected", row["rejected"], "assistant")}
    record = {"prompt": _messages(path, index, "prompt", row["prompt"], "user"), "answer": str(row["answer"])}
    record["task"] = str(row["task"]) if row.get("task") is not None else "custom"
    return record


def user_prompts(record: dict[str, Any], kind: str) -> list[str]:
    """The user messages of a normalized record (used to keep held-out prompts out of training data)."""
    messages = record["messages"] if kind == "sft" else record["prompt"]
    return [m["content"] for m in messages if m["role"] == "user"]
