"""Byte sizes as people write them in recipes and flags: ``5MB``, ``512MiB``, ``2g``, ``1073741824``.

One grammar for every size the project reads (a bundle's ``max_shard_size``, the server's ``--kv-memory``):
decimal units (k, M, G, T; with or without the trailing B) are powers of 1000 and binary units (KiB, MiB,
GiB, TiB) powers of 1024, as transformers' ``max_shard_size`` reads them. Case does not matter.
"""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_DECIMAL = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
_BINARY = {"k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


def _multiplier(unit: str) -> int | None:
    unit = unit.lower().removesuffix("b")
    if unit.endswith("i"):
        return _BINARY.get(unit[:-1])
    return _DECIMAL.get(unit)


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes in ``text``; a ValueError naming ``what`` (the recipe key or flag) when it is not a size."""
    match = _SIZE.match(str(text))
    multiplier = _multiplier(match.group(2)) if match else None
    if match is None or multiplier is None:
        raise ValueError(f"{what}: cannot parse size {text!r} (examples: 5MB, 512MiB, 1073741824)")
    value = int(float(match.group(1)) * multiplier)
    if value < 1:
        raise ValueError(f"{what}: {text!r} must be at least one byte")
    return value


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that divides them: 268435456 → '256MiB' (parse_size reads it back)."""
    for unit, mult in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
