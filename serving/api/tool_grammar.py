"""What a constrained tool choice (``required``, a named function) holds the reply to: the calls in the format
the model was shown (``tool_formats``), so that the grammar and the prompt tell the model the same thing.

- **fallback**: the JSON array the system message asks for, ``[{"name": ..., "arguments": {...}}]``;
- **llama**: one ``{"name": ..., "parameters": {...}}`` object, as those templates take one call a turn;
- **hermes**: each call a ``{"name": ..., "arguments": ...}`` object inside ``<tool_call>`` tags, a line apart; a
  Lark grammar with the object as ``%json``;
- **mistral** and **granite**: the marker, then the fallback's array. The grammar names the marker by id
  (``<[id]>``) where the vocabulary has it as one token, so the model writes the one token its template taught
  it, never the characters spelled out; a reply decoded without special tokens is then the fallback's array,
  which ``parse_calls`` reads;
- **qwen-xml**: ``<function=...>`` elements in ``<tool_call>`` tags (``tool_xml.call_grammar``);
- **pythonic**: a Python list of calls with keyword arguments (``tool_pythonic.call_grammar``).

Every JSON format is written compactly in schema order, which is what ``CallStream`` reads as it streams.
"""

from __future__ import annotations

import json
from typing import Any

from serving.api import tool_pythonic, tool_xml
from serving.api.tool_calls import ToolPlan
from serving.api.tool_formats import ARRAY_MARKERS, HERMES, LLAMA, PYTHONIC, QWEN_XML
from serving.engine.structured_output import StructuredOutput

MAX_PARALLEL_CALLS = 8


def call_grammar(plan: ToolPlan, fmt: str, tokenizer: Any = None) -> StructuredOutput:
    """The grammar of a reply that is only calls to the plan's tools (the named one, if it names one)."""
    if fmt in ARRAY_MARKERS:
        calls = json.dumps({**call_schema(plan), "x-guidance": {"whitespace_flexible": False}}, separators=(",", ":"))
        opening = _marker(tokenizer, ARRAY_MARKERS[fmt])
        return StructuredOutput.lark(f"start: {opening} body\nbody: %json {calls}", where="tools")
    if fmt in (QWEN_XML, PYTHONIC):
        build = tool_xml.call_grammar if fmt == QWEN_XML else tool_pythonic.call_grammar
        grammar, parts = build(plan.tools, plan.name, plan.parallel, MAX_PARALLEL_CALLS)
        return StructuredOutput.lark(grammar, where="tools", json_parts=parts)
    if fmt == LLAMA:
        return StructuredOutput.json_schema(_one_of(_call_objects(plan, "parameters")), where="tools")
    if fmt == HERMES:
        call = json.dumps({**_one_of(_call_objects(plan, "arguments")),
                           "x-guidance": {"whitespace_flexible": False}}, separators=(",", ":"))
        start = rf'start: call ("\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if plan.parallel else "start: call"
        lark = "\n".join([start,
                          r'call: "<tool_call>\n" body "\n</tool_call>"',
                          f"body: %json {call}"])
        return StructuredOutput.lark(lark, where="tools")
    return StructuredOutput.json_schema(call_schema(plan), where="tools")


def _marker(tokenizer: Any, marker: str) -> str:
    """A format's marker (``[TOOL_CALLS]``, ``<|tool_call|>``) in the grammar: the token by id where the vocabulary
    has it as one token, else the text (a template that spells it out in a vocabulary without it)."""
    ids = tokenizer.encode(marker, add_special_tokens=False) if tokenizer is not None else []
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(marker)


def call_schema(plan: ToolPlan) -> dict:
    """The JSON schema of the fallback reply: an array of calls to the plan's tools (one, unless parallel)."""
    return {"type": "array", "items": _one_of(_call_objects(plan, "arguments")), "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if plan.parallel else 1}


def _call_objects(plan: ToolPlan, arguments_key: str) -> list[dict]:
    tools = [t for t in plan.tools if plan.name is None or t["function"]["name"] == plan.name]
    return [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
             "properties": {"name": {"const": t["function"]["name"]},
                            arguments_key: t["function"].get("parameters") or {"type": "object"}}} for t in tools]


def _one_of(calls: list[dict]) -> dict:
    return calls[0] if len(calls) == 1 else {"anyOf": calls}
