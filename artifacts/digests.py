"""Content digests used for caching, lineage and bundle checksums.

One place computes them so a digest written by one stage is recomputed identically by another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """Stream the file so multi-GB shards never sit in memory at once."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: equal objects give equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest_json(obj: Any) -> str:
    return sha256_bytes(canonical_json(obj).encode("utf-8"))
