"""The eval record: results about a bundle, stored beside it without changing it.

Why beside and not inside the manifest: the manifest is the snapshot's identity (its digest is what the
registry tags and servers trust). Evaluating must never alter it, so `eval_record.json` refers to the
manifest by digest; the verifier ignores the file, and `read_eval_record` refuses a record whose digest
belongs to another manifest (a record copied next to a different bundle, or a stale one).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from artifacts.adapter_bundle import ADAPTER_MANIFEST, bundle_digest, is_adapter_bundle
from artifacts.common.atomic import atomic_write_text
from artifacts.errors import EvalRecordError
from artifacts.manifest import EVAL_RECORD_FILE, MANIFEST_FILE

EVAL_RECORD_SCHEMA = 1


@dataclass
class EvalRecord:
    manifest_digest: str
    metrics: dict[str, float] = field(default_factory=dict)
    gates: dict[str, Any] = field(default_factory=dict)  # gate name -> outcome (e.g. {"passed": bool, ...})
    passed: bool | None = None
    results: Any = None  # the evals package's full JSON payload, kept opaque here
    bundle_name: str = ""
    bundle_version: str = ""
    created_at: str = ""
    schema_version: int = EVAL_RECORD_SCHEMA

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def write_eval_record(
    bundle_dir: str | Path,
    record: EvalRecord | dict[str, Any] | None = None,
    *,
    metrics: dict[str, float] | None = None,
    gates: dict[str, Any] | None = None,
    passed: bool | None = None,
    results: Any = None,
) -> Path:
    """Write `eval_record.json` next to the manifest (atomically), stamped with the manifest's digest.

    `record` may be an EvalRecord, a dict with the same keys (manifest_digest is filled in), or None with
    the keyword fields. An EvalRecord naming a different manifest digest is refused."""
    bundle_dir = Path(bundle_dir)
    digest = bundle_digest(bundle_dir)
    if isinstance(record, EvalRecord):
        if record.manifest_digest and record.manifest_digest != digest:
            raise EvalRecordError(f"{bundle_dir / EVAL_RECORD_FILE}: record is for manifest "
                                  f"{record.manifest_digest[:12]}, bundle has {digest[:12]}")
        record.manifest_digest = digest
    else:
        data = dict(record or {})
        unknown = set(data) - set(EvalRecord.__dataclass_fields__)
        if unknown:
            raise EvalRecordError(f"{EVAL_RECORD_FILE}: unknown field(s) {sorted(unknown)}")
        if data.get("manifest_digest") not in (None, "", digest):
            raise EvalRecordError(f"{bundle_dir / EVAL_RECORD_FILE}: record is for manifest "
                                  f"{data['manifest_digest'][:12]}, bundle has {digest[:12]}")
        data["manifest_digest"] = digest
        for key, value in (("metrics", metrics), ("gates", gates), ("passed", passed), ("results", results)):
            if value is not None:
                data[key] = value
        record = EvalRecord(**data)
    manifest_file = ADAPTER_MANIFEST if is_adapter_bundle(bundle_dir) else MANIFEST_FILE
    manifest = json.loads((bundle_dir / manifest_file).read_text(encoding="utf-8"))
    record.bundle_name = record.bundle_name or manifest.get("name", "")
    record.bundle_version = record.bundle_version or manifest.get("version", "")
    record.created_at = record.created_at or datetime.now(UTC).isoformat(timespec="seconds")
    return atomic_write_text(bundle_dir / EVAL_RECORD_FILE, record.to_json())


def read_eval_record(bundle_dir: str | Path, check_digest: bool = True) -> EvalRecord:
    """Read the record; with `check_digest`, refuse one that refers to another manifest."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / EVAL_RECORD_FILE
    if not path.is_file():
        raise EvalRecordError(f"{path}: missing (the bundle has not been evaluated)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("schema_version") != EVAL_RECORD_SCHEMA:
            raise EvalRecordError(f"{path}: schema_version {data.get('schema_version')!r} is not supported")
        record = EvalRecord(**data)
    except json.JSONDecodeError as exc:
        raise EvalRecordError(f"{path}: not valid JSON ({exc.msg})") from exc
    except TypeError as exc:
        raise EvalRecordError(f"{path}: malformed record ({exc})") from exc
    if check_digest:
        digest = bundle_digest(bundle_dir)
        if record.manifest_digest != digest:
            raise EvalRecordError(f"{path}: refers to manifest {record.manifest_digest[:12]}, but the bundle's "
                                  f"manifest is {digest[:12]} (stale or copied record)")
    return record
