"""Random JSON schemas of the shapes programs send with ``response_format``: the test bed for constrained decoding.

A grammar library is only as good as the schemas it gets right, so the schemas are drawn, not hand-picked:
objects (required and optional fields, ``additionalProperties: false`` as OpenAI's strict mode asks), arrays
with length bounds, enums, nested objects, integers and numbers with bounds, booleans, strings with a length
cap. Strings are capped so a random model cannot ramble inside one until ``max_tokens``: the grammar decides
where a reply ends, the cap keeps that point near. Used by ``benchmarks/grammar_libraries.py`` and the tests.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("id", "name", "count", "price", "tags", "active", "owner", "items", "score", "kind", "note", "size",
          "city", "level", "unit", "total", "label", "rank", "color", "when")
_ENUM_VALUES = ("red", "green", "blue", "small", "large", "yes", "no", "alpha", "beta", "gamma")


def random_schema(rng: random.Random, max_depth: int = 2) -> dict[str, Any]:
    """One object schema; ``max_depth`` bounds how far objects and arrays nest."""
    return _object(rng, max_depth)


def random_schemas(n: int, seed: int = 0, max_depth: int = 2) -> list[dict[str, Any]]:
    """``n`` schemas; the same arguments give the same list."""
    rng = random.Random(seed)
    return [random_schema(rng, max_depth) for _ in range(n)]


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties = {name: _value(rng, depth - 1) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth > 0 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(_ENUM_VALUES, rng.randint(1, 4))}
    if kind == "object":
        return _object(rng, depth)
    low = rng.randint(0, 2)
    return {"type": "array", "items": _value(rng, depth - 1), "minItems": low, "maxItems": low + rng.randint(0, 3)}
