"""The pythonic tool-call format of Llama 4 and Llama 3.2 (their templates ask for
``[func_name1(param1=value1, param2=value2), func_name2(...)]``): its grammar, its reader and its streaming reader.

A reply of calls is a Python list of calls with keyword arguments. The grammar writes strings, numbers, arrays and
objects as JSON (a JSON string or number is a Python literal too) and a boolean or null argument the Python way
(``True``, ``None``), as the templates' examples do. The reader takes either spelling anywhere (``true`` and
``True``), so a free reply under ``auto`` written the JSON way inside a list or a dict is read as well.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any

from serving.api.tool_formats import CallReader
from serving.api.tool_xml import json_part, offered, parameter_schemas

_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def read_calls(text: str, tools: dict[str, dict]) -> list[tuple[str, dict]] | None:
    """(name, arguments) for each call in ``text``, or None when it is not a list of calls to ``tools`` with
    keyword arguments whose values are literals."""
    stripped = text.strip()
    if not stripped.startswith("["):
        return None
    try:
        tree = ast.parse(stripped, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in tools
                and not node.args and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            calls.append((node.func.id, {k.arg: _literal(k.value) for k in node.keywords}))
        except ValueError:
            return None
    return calls


def _literal(node: ast.AST) -> Any:
    """A literal argument: constants, True/False/None in either spelling, lists, tuples, dicts, signed numbers."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a literal")


@dataclass
class PythonicCallStream(CallReader):
    """Reads a list of calls as it streams and says, per delta, what OpenAI's chunks carry: a call's ``id`` and
    ``name`` once its ``(`` arrives, then its arguments as one JSON fragment once its ``)`` closes it (a call's
    arguments are Python until then; the fragment is the very text the whole reply's ``arguments`` has)."""

    _depth: int = 0  # 1 inside the list, 2 inside a call's parentheses, more inside its values
    _quote: str | None = None
    _escaped: bool = False
    _call_start: int = 0  # where the current call's name begins

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        deltas: list[dict] = []
        while self._pos < len(self.buffer):
            ch = self.buffer[self._pos]
            self._pos += 1
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = None
                continue
            if ch in "\"'":
                self._quote = ch
            elif ch in "([{":
                if ch == "(" and self._depth == 1:
                    deltas.append(self._opening(self.buffer[self._call_start:self._pos - 1].strip(" ,\n")))
                self._depth += 1
                if self._depth == 1:
                    self._call_start = self._pos
            elif ch in ")]}":
                self._depth -= 1
                if ch == ")" and self._depth == 1:
                    one = read_calls(f"[{self.buffer[self._call_start:self._pos].lstrip(' ,')}]", self.tools)
                    arguments = one[0][1] if one else {}
                    deltas.append({"index": self.calls, "function": {
                        "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))}})
                    self.calls += 1
                    self._call_start = self._pos
        return deltas


def call_grammar(tools: tuple[dict, ...], name: str | None, parallel: bool,
                 max_calls: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    """A Lark grammar (llguidance) for a list of calls to ``tools`` (to the one ``name``d, if one is): keyword
    arguments in schema order, every required one, each optional one in its place or left out, values held to
    their schemas; and the grammar's JSON parts with their request paths."""
    rules = [rf'start: "[" call (", " call){{0,{max_calls - 1}}} "]"' if parallel else 'start: "[" call "]"']
    functions, parts = [], []
    for i, tool, required in offered(tools, name):
        params = list(parameter_schemas(tool).items())
        for j, (key, schema) in enumerate(params):
            rules += _argument_rules(f"arg_{i}_{j}", key, schema, f"tools.{i}.function.parameters.properties.{key}",
                                     parts)
        rules += _sequence_rules(f"fn_{i}", [key in required for key, _ in params])
        first = f" fn_{i}_first_0" if params else ""
        rules.append(f"fn_{i}: {json.dumps(tool['function']['name'] + '(')}{first} \")\"")
        functions.append(f"fn_{i}")
    rules.insert(1, "call: " + " | ".join(functions))
    return "\n".join(rules), tuple(parts)


def _sequence_rules(prefix: str, required: list[bool]) -> list[str]:
    """Rules for the arguments ``arg_I_0 .. arg_I_n-1`` in order, comma-separated, each optional one free to be
    left out: ``first_k`` starts the list at argument k, ``rest_k`` goes on after one was written."""
    n = len(required)
    arg = prefix.replace("fn_", "arg_")
    rules = []

    def rest(k: int) -> str:
        return f" {prefix}_rest_{k}" if k < n else ""

    def first(k: int) -> str:
        return f"{prefix}_first_{k}" if k < n else ""

    for k in range(n):
        if required[k]:
            rules.append(f'{prefix}_rest_{k}: ", " {arg}_{k}{rest(k + 1)}')
            rules.append(f"{prefix}_first_{k}: {arg}_{k}{rest(k + 1)}")
        else:
            rules.append(f'{prefix}_rest_{k}: (", " {arg}_{k})?{rest(k + 1)}')
            later = first(k + 1)
            rules.append(f"{prefix}_first_{k}: {arg}_{k}{rest(k + 1)} | {later}" if later
                         else f"{prefix}_first_{k}: ({arg}_{k})?")
    return rules


def _argument_rules(rule: str, key: str, schema: Any, where: str, parts: list[tuple[str, str]]) -> list[str]:
    """``key=value``: a boolean or null the Python way, anything else as JSON held to its schema (which joins
    ``parts``)."""
    name = json.dumps(f"{key}=")
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "boolean":
        return [f'{rule}: {name} ("True" | "False")']
    if kind == "null":
        return [f'{rule}: {name} "None"']
    text = json_part(schema)
    parts.append((where, text))
    return [f"{rule}: {name} {rule}_json", f"{rule}_json: %json {text}"]
