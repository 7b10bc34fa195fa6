"""Which tool-call format a model was taught, read from its chat template's text.

A model calls tools well only in the format its template shows it, so the server asks for calls in that format
(``tool_grammar``), reads them back in it (``tool_calls``, ``tool_xml``) and streams them as OpenAI's deltas:

- **fallback**: templates without tools, ours among them: a JSON array of ``{"name", "arguments"}`` objects, asked
  for by a system message that lists the tools;
- **llama** (Llama 3.1-3.3): one ``{"name": ..., "parameters": {...}}`` object;
- **hermes** (Qwen2.5, Qwen3, Hermes): ``{"name", "arguments"}`` objects in ``<tool_call>`` tags, a line apart;
- **mistral** (v3+ templates) and **granite** (IBM Granite 3.x): a marker, then the fallback's array. Mistral's
  marker is its ``[TOOL_CALLS]`` control token, Granite's ``<|tool_call|>``;
- **qwen-xml** (Qwen3-Coder, Qwen3-Next): ``<tool_call>`` tags around ``<function=NAME>`` with one
  ``<parameter=KEY>`` element per argument, strings written raw and other values as JSON. Its templates hold
  ``<tool_call>`` too, so it is told apart from hermes by ``<function=`` first;
- **pythonic** (Llama 4, and Llama 3.2's pythonic templates): a Python list of calls with keyword arguments,
  ``[get_weather(city="Oslo", days=2)]``, told by the example the templates give, ``[func_name1(``.

A template that takes tools in a format we do not know gets the fallback's array.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

FALLBACK, LLAMA, HERMES, MISTRAL, GRANITE, QWEN_XML = "fallback", "llama", "hermes", "mistral", "granite", "qwen-xml"
PYTHONIC = "pythonic"
MISTRAL_CALLS = "[TOOL_CALLS]"  # the control token Mistral's templates open a reply of calls with
GRANITE_CALLS = "<|tool_call|>"  # the special token Granite's templates open one with
# the formats that are a marker, then the fallback's array: what the reply opens with
ARRAY_MARKERS = {MISTRAL: MISTRAL_CALLS, GRANITE: GRANITE_CALLS}


def template_takes_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def call_format(tokenizer: Any) -> str:
    """The tool-call format ``tokenizer``'s chat template shows the model (read from the template's text; the
    order matters where one format's marks contain another's)."""
    if not template_takes_tools(tokenizer):
        return FALLBACK
    template = tokenizer.chat_template
    if "<function=" in template and "<parameter=" in template:
        return QWEN_XML
    if GRANITE_CALLS in template:
        return GRANITE
    if "<tool_call>" in template:
        return HERMES
    if MISTRAL_CALLS in template:
        return MISTRAL
    if "[func_name1(" in template:
        return PYTHONIC
    if '"parameters"' in template:
        return LLAMA
    return FALLBACK


def new_call_id(short: bool = False) -> str:
    """OpenAI's shape (``call_`` and 24 hex digits), or the 9 letters and digits Mistral's templates require."""
    return uuid.uuid4().hex[:9] if short else f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallReader:
    """What every streaming reader of calls keeps (``tool_calls.CallStream``, ``tool_xml.XmlCallStream``,
    ``tool_pythonic.PythonicCallStream``): the reply so far, how far it has been read, the calls opened and their
    ids; ``tools`` by name, for the readers that take an argument's type from its schema."""

    tools: dict[str, dict] = field(default_factory=dict)
    short_ids: bool = False
    buffer: str = ""
    calls: int = 0
    ids: list[str] = field(default_factory=list)
    _pos: int = 0

    def feed(self, text: str) -> list[dict]:
        """The ``tool_calls`` deltas for ``text``, the next piece of the reply (each format's reader says how)."""
        raise NotImplementedError

    def _opening(self, name: str) -> dict:
        """The first delta of the next call: its id, its name, no arguments yet."""
        self.ids.append(new_call_id(self.short_ids))
        return {"index": self.calls, "id": self.ids[-1], "type": "function",
                "function": {"name": name, "arguments": ""}}
