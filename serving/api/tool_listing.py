"""The fallback's tool listing: each function as one TypeScript-like signature line, not its JSON schema.

A model whose template knows no tools reads the listing as prose, so the listing only has to say what each
function is called, what it takes and what it does. JSON Schema spends most of its length on keywords
(``"type"``, ``"properties"``, ``"required"``, ``"additionalProperties"``): the rollout's one-parameter answer tool
took 245 tokens of the embedded byte-level tokenizer as JSON (420 with the instructions and a task, more than that
model's whole 256-token context), and 62 as a signature. The schema itself still binds the reply: ``required``
and named choices hold it to the parameters with a grammar, and ``auto`` replies are parsed against them.

    get_weather(city: string, unit?: "c" | "f", days?: integer) - Get the forecast.
"""

from __future__ import annotations

import json
from typing import Any

_MAX_DEPTH = 6  # deeper than this, a schema is shown as `object` (a listing is a hint, not the contract)


def listing(functions: list[dict[str, Any]]) -> str:
    """One line per function: its signature, then its description when it has one."""
    return "\n".join(signature(f) for f in functions)


def signature(function: dict[str, Any]) -> str:
    """``name(param: type, optional?: type) - description``."""
    parameters = function.get("parameters") or {}
    line = f"{function['name']}({_fields(parameters, parameters, 0)})"
    description = " ".join(str(function.get("description") or "").split())
    return f"{line} - {description}" if description else line


def type_of(schema: Any, root: dict[str, Any], depth: int = 0) -> str:
    """A schema as a short type expression: ``string``, ``"a" | "b"``, ``integer[]``, ``{x: number}``, ..."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return "any" if schema in (True, {}) else "object"
    if "$ref" in schema:
        return _referenced(schema["$ref"], root, depth)
    if "const" in schema:
        return _literal(schema["const"])
    if "enum" in schema:
        return " | ".join(_literal(v) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(type_of(s, root, depth + 1) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(type_of({**schema, "type": k}, root, depth) for k in kind)
    if kind == "array" or "items" in schema:
        return f"{_grouped(type_of(schema.get('items', {}), root, depth + 1))}[]"
    if kind == "object" or "properties" in schema:
        fields = _fields(schema, root, depth + 1)
        return f"{{{fields}}}" if fields else "object"
    return kind if isinstance(kind, str) else "any"


def _fields(schema: dict[str, Any], root: dict[str, Any], depth: int) -> str:
    required = set(schema.get("required") or [])
    properties = schema.get("properties") or {}
    return ", ".join(f"{name}{'' if name in required else '?'}: {type_of(sub, root, depth)}"
                     for name, sub in properties.items())


def _referenced(ref: str, root: dict[str, Any], depth: int) -> str:
    """A local ``#/$defs/X`` reference, shown as its target's type; anything else by its last name."""
    target: Any = root
    if ref.startswith("#/"):
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
    if isinstance(target, dict) and target is not root:
        return type_of(target, root, depth + 1)
    return ref.rsplit("/", 1)[-1] or "object"


def _literal(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _grouped(expression: str) -> str:
    """A union inside an array keeps its parentheses: ``("a" | "b")[]``."""
    return f"({expression})" if " | " in expression else expression
