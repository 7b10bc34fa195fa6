"""What a constrained tool choice (``required``, a named function) holds the reply to: the calls in the format
the model was shown, so that the grammar and the prompt tell the model the same thing.

- **fallback** (a template without tools, ours among them): the JSON array the system message asks for,
  ``[{"name": ..., "arguments": {...}}]``;
- **llama** (Llama 3.1-3.3 templates: "respond with a JSON for a function call ... ``{"name": function name,
  "parameters": ...}``"): one ``{"name": ..., "parameters": {...}}`` object, as those templates take one call a turn;
- **hermes** (Qwen2.5, Hermes and the templates that copied them): each call a ``{"name": ..., "arguments": ...}``
  object inside ``<tool_call>`` tags, a line apart; a Lark grammar with the object as ``%json``;
- **mistral** (Mistral's v3+ templates, Mistral-Nemo, Mistral-Small): the control token ``[TOOL_CALLS]`` then a
  JSON array of ``{"name": ..., "arguments": {...}}``. The grammar names the token by id (``<[id]>``), so the model
  writes the one token its template taught it, never the twelve characters spelled out; a reply decoded without
  special tokens is then the fallback's array, which ``parse_calls`` reads.

A template that takes tools in a format we do not know gets the fallback's array, which ``parse_calls`` reads.
Every format is written compactly in schema order, which is what ``CallStream`` reads as it streams.
"""

from __future__ import annotations

import json
from typing import Any

from serving.api.tool_calls import MISTRAL_CALLS, ToolPlan, template_takes_tools
from serving.engine.structured_output import StructuredOutput

FALLBACK, LLAMA, HERMES, MISTRAL = "fallback", "llama", "hermes", "mistral"
MAX_PARALLEL_CALLS = 8


def call_format(tokenizer: Any) -> str:
    """The tool-call format ``tokenizer``'s chat template shows the model (read from the template's text)."""
    if not template_takes_tools(tokenizer):
        return FALLBACK
    template = tokenizer.chat_template
    if "<tool_call>" in template:
        return HERMES
    if MISTRAL_CALLS in template:
        return MISTRAL
    if '"parameters"' in template:
        return LLAMA
    return FALLBACK


def call_grammar(plan: ToolPlan, fmt: str, tokenizer: Any = None) -> StructuredOutput:
    """The grammar of a reply that is only calls to the plan's tools (the named one, if it names one)."""
    if fmt == MISTRAL:
        calls = json.dumps({**call_schema(plan), "x-guidance": {"whitespace_flexible": False}}, separators=(",", ":"))
        return StructuredOutput.lark(f"start: {_mistral_opening(tokenizer)} body\nbody: %json {calls}", where="tools")
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


def _mistral_opening(tokenizer: Any) -> str:
    """``[TOOL_CALLS]`` in the grammar: the control token by id where the vocabulary has it as one token, else
    the text (a template that spells it out in a vocabulary without it)."""
    ids = tokenizer.encode(MISTRAL_CALLS, add_special_tokens=False) if tokenizer is not None else []
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(MISTRAL_CALLS)


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
