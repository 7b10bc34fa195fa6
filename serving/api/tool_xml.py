"""The XML tool-call format of Qwen3-Coder and Qwen3-Next: its grammar, its reader and its streaming reader.

A call is written the way the template writes earlier calls back, one element per argument::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A string argument is written raw (no quotes, newlines allowed), any other value as JSON. Whether a value is raw is
decided by its schema alone (``is_raw_string``), the same way when the grammar is built, when a reply is read and
when it is streamed, so the three agree on every argument.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from serving.api.errors import APIError
from serving.api.tool_formats import CallReader

# string keywords a raw value's grammar can hold; a pattern or a format is a 400 in this format (the JSON formats
# hold them, as JSON strings)
_RAW_STRING_KEYWORDS = frozenset({"type", "minLength", "maxLength", "enum", "const", "description", "title",
                                  "default", "examples"})
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_FUNCTION_OPEN = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_NEXT_IN_FUNCTION = re.compile(_PARAMETER.pattern + r"|</function>", re.DOTALL)


def is_raw_string(schema: Any) -> bool:
    """Whether an argument of ``schema`` is written raw: a string type, or an enum or const of strings only."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    return "type" not in schema and bool(choices) and all(isinstance(c, str) for c in choices)


def offered(tools: tuple[dict, ...], name: str | None) -> list[tuple[int, dict, set[str]]]:
    """(index in the request, tool, its required arguments) for each tool a grammar covers: every one, or the one
    a named choice forces."""
    return [(i, tool, set((tool["function"].get("parameters") or {}).get("required") or []))
            for i, tool in enumerate(tools) if name is None or tool["function"]["name"] == name]


def json_part(schema: Any) -> str:
    """An argument's schema as a grammar's compact ``%json`` part (no whitespace a model could ramble in)."""
    compact = {**(schema if isinstance(schema, dict) else {}), "x-guidance": {"whitespace_flexible": False}}
    return json.dumps(compact, separators=(",", ":"))


def parameter_schemas(tool: dict) -> dict[str, Any]:
    """A tool's arguments by name, in the order its schema lists them (required ones it does not describe last)."""
    parameters = tool["function"].get("parameters") or {}
    properties = dict(parameters.get("properties") or {})
    for name in parameters.get("required") or []:
        properties.setdefault(name, {})
    return properties


def value_of(raw: str, schema: Any) -> Any:
    """An argument as written, read by its schema: raw text for a string, else JSON (a template that wrote a
    Python bool, ``True``, is read as one); text that is no JSON stays text."""
    if is_raw_string(schema):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {"True": True, "False": False}.get(raw.strip(), raw)


def read_calls(text: str, tools: dict[str, dict]) -> list[tuple[str, dict]] | None:
    """(name, arguments) for each call in ``text``, or None when it is not a reply of calls in this format (or
    calls a function ``tools`` does not have)."""
    if not text.startswith(("<tool_call>", "<function=")):
        return None
    calls = []
    for name, body in _FUNCTION.findall(text):
        if name not in tools:
            return None
        schemas = parameter_schemas(tools[name])
        calls.append((name, {key: value_of(raw, schemas.get(key)) for key, raw in _PARAMETER.findall(body)}))
    return calls or None


@dataclass
class XmlCallStream(CallReader):
    """Reads calls in this format as they stream and says, per delta, what OpenAI's chunks carry: a call's ``id``
    and ``name`` once ``<function=NAME>`` is complete, then its arguments as JSON text, one fragment per argument
    as each ``</parameter>`` arrives, the closing brace with ``</function>``. The fragments of a call join into the
    very text the whole reply's ``arguments`` has."""

    _function: str | None = None
    _arguments: int = 0

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        deltas: list[dict] = []
        while True:
            if self._function is None:
                opened = _FUNCTION_OPEN.search(self.buffer, self._pos)
                if opened is None:
                    return deltas
                self._function, self._arguments, self._pos = opened[1], 0, opened.end()
                deltas.append(self._opening(opened[1]))
                continue
            found = _NEXT_IN_FUNCTION.search(self.buffer, self._pos)
            if found is None:
                return deltas
            self._pos = found.end()
            if found[0] == "</function>":
                fragment = "}" if self._arguments else "{}"
                deltas.append({"index": self.calls, "function": {"arguments": fragment}})
                self._function, self.calls = None, self.calls + 1
                continue
            schema = parameter_schemas(self.tools[self._function]).get(found[1]) if self._function in self.tools \
                else None
            value = json.dumps(value_of(found[2], schema), ensure_ascii=False, separators=(",", ":"))
            opening = "," if self._arguments else "{"
            self._arguments += 1
            deltas.append({"index": self.calls, "function": {
                "arguments": f"{opening}{json.dumps(found[1], ensure_ascii=False)}:{value}"}})


def call_grammar(tools: tuple[dict, ...], name: str | None, parallel: bool,
                 max_calls: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    """A Lark grammar (llguidance) for a reply of calls to ``tools`` (to the one ``name``d, if one is): every
    required argument in schema order, each optional one in its place or left out, strings raw within their length
    bounds, other values held to their schema as JSON; and the grammar's JSON parts with their request paths."""
    rules = [rf'start: call ("\n" call){{0,{max_calls - 1}}}' if parallel else "start: call"]
    functions, parts = [], []
    for i, tool, required in offered(tools, name):
        arguments = []
        for j, (key, schema) in enumerate(parameter_schemas(tool).items()):
            where = f"tools.{i}.function.parameters.properties.{key}"
            rules += _argument_rules(f"arg_{i}_{j}", key, schema, where, parts)
            arguments.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
        opening = json.dumps(f"<function={tool['function']['name']}>\n")
        rules.append(f"fn_{i}: {opening} {' '.join(arguments)} " + '"</function>\\n"')
        functions.append(f"fn_{i}")
    rules.insert(1, 'call: "<tool_call>\\n" (' + " | ".join(functions) + ') "</tool_call>"')
    return "\n".join(rules), tuple(parts)


def _argument_rules(rule: str, key: str, schema: Any, where: str, parts: list[tuple[str, str]]) -> list[str]:
    """The rules of one argument: its opening tag, its value, its closing tag (a JSON value's schema joins
    ``parts``)."""
    opening, closing = json.dumps(f"<parameter={key}>\n"), json.dumps("\n</parameter>\n")
    if not is_raw_string(schema):
        text = json_part(schema)
        parts.append((where, text))
        return [f"{rule}: {opening} {rule}_json {closing}", f"{rule}_json: %json {text}"]
    unsupported = sorted(set(schema) - _RAW_STRING_KEYWORDS)
    if unsupported:
        raise APIError(400, f"{where}.{unsupported[0]}: not supported for a string argument in this model's "
                            "tool format (its strings are written raw)", param=f"{where}.{unsupported[0]}")
    choices = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    if choices:
        return [f"{rule}: {opening} (" + " | ".join(json.dumps(c) for c in choices) + f") {closing}"]
    least, most = int(schema.get("minLength", 0)), schema.get("maxLength")
    bounds = f"{{{least},{'' if most is None else int(most)}}}"
    # a lazy lexeme ends at the first closing tag: the value holds anything else, newlines included
    return [f"{rule}: {opening} {rule}_text {json.dumps(chr(10))}",
            f"{rule}_text[lazy]: /(?s:.{bounds})\\n<\\/parameter>/"]
