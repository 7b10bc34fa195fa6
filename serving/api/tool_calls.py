"""Tool calling (OpenAI's ``tools`` and ``tool_choice``): what the model is shown, what it may write, what the
client reads back.

Two ways a model calls a tool:

- **its chat template's own format**, where the template takes ``tools`` (the formats, and how one is told from
  another, are in ``tool_formats.py``): the tools go to the template and the reply is read in that format;
- **the fallback** for templates without tools (ours among them): a system message lists the tools, a signature
  line each (``tool_listing.py``), and asks for a JSON array of calls, ``[{"name": ..., "arguments": {...}}]``.

``tool_choice`` ``required`` or a named function holds the reply to calls in the format the model was shown, with
a grammar (``tool_grammar.py``, enforced like any ``response_format``), so the calls parse and their arguments
validate whatever the model. ``auto`` leaves the model free and reads a call out of its reply if it wrote one; ``none``
never reads one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from serving.api import tool_listing, tool_pythonic, tool_xml
from serving.api.errors import APIError
from serving.api.tool_formats import (
    ARRAY_MARKERS,
    FALLBACK,
    HERMES,
    MISTRAL,
    PYTHONIC,
    QWEN_XML,
    CallReader,
    new_call_id,
)

FALLBACK_INSTRUCTIONS = ("You can call these functions. To call one or more, reply with only a JSON array of calls, "
                         'like [{"name": "a_function", "arguments": {"a": 1}}].\nFunctions:\n')
# under `required` or a named choice the grammar writes the array, so the prompt need not teach its shape: a header
# of a few words instead of the ~150 tokens the instructions cost a byte-level tokenizer (a small context's room)
CONSTRAINED_HEADER = "Reply with a call to one of these functions:\n"
# what a reply of calls may open with, besides JSON's [ and {: the tags and markers of the formats that have them
_CALL_OPENINGS = ("<tool_call>", "<function=", *ARRAY_MARKERS.values())
# the formats whose calls open with a tag: a reply may say something first ("Let me check.") and call after it
TAG, TAGGED_FORMATS = "<tool_call>", frozenset({HERMES, QWEN_XML})
# the roles Granite 3.0's templates read an earlier call and a tool's result under (``template_messages``)
GRANITE_CALL_ROLE, GRANITE_RESULT_ROLE = "assistant_tool_call", "tool_response"
_TAGGED_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and how it lets the model use them (``choice``: none, auto, required or named)."""

    tools: tuple[dict, ...]
    choice: str
    name: str | None = None  # the function a named choice forces
    parallel: bool = True
    fmt: str = FALLBACK  # the format the model is shown (``tool_formats.call_format``)

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def by_name(self) -> dict[str, dict]:
        return {t["function"]["name"]: t for t in self.tools}

    @property
    def short_ids(self) -> bool:
        """Mistral's templates refuse a call id that is not 9 letters and digits (``raise_exception``), so a client
        sending the calls back would get a 400: its calls get ids of that shape."""
        return self.fmt == MISTRAL

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's plan; None when it brings no tools. A choice naming a function it did not send is a 400."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice: needs tools", param="tool_choice")
        return None
    specs = tuple(t.model_dump(exclude_none=True) for t in tools)
    if tool_choice is None or isinstance(tool_choice, str):
        return ToolPlan(specs, tool_choice or "auto", parallel=parallel is not False)
    name = tool_choice.function.name
    if name not in {t["function"]["name"] for t in specs}:
        raise APIError(400, f"tool_choice.function.name: no tool named {name!r} in tools",
                       param="tool_choice.function.name")
    return ToolPlan(specs, "named", name, parallel=False)


def fallback_messages(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """The conversation for a template without tools: the tools described in the system message, earlier calls
    written as the JSON arrays the model is asked for, tool results as messages of role ``tool``."""
    header = CONSTRAINED_HEADER if plan.constrained else FALLBACK_INSTRUCTIONS
    listing = header + tool_listing.listing([t["function"] for t in plan.tools])
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("tool_calls"):
            m["content"] = json.dumps([{"name": c["function"]["name"], "arguments": _arguments(c)}
                                       for c in m.pop("tool_calls")], separators=(",", ":"))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
    else:
        out.insert(0, {"role": "system", "content": listing})
    return out


def template_messages(messages: list[dict], template: str = "", fmt: str = FALLBACK) -> list[dict]:
    """The conversation for a template that takes tools: call arguments as objects (what HF templates expect).

    Granite's templates do not read OpenAI's ``tool_calls``, and would write an earlier call as an empty assistant
    turn. Granite 3.0's read calls and results under roles of their own: an ``assistant_tool_call`` turn whose
    content is the calls' JSON array, a ``tool_response`` turn (given OpenAI's ``tool`` they leave the result out).
    Granite 3.1-3.3's write every turn's content: the calls go there, after their marker, as the model writes them."""
    own_roles = GRANITE_CALL_ROLE in template and GRANITE_RESULT_ROLE in template
    calls_as_text = fmt in ARRAY_MARKERS and "tool_calls" not in template
    out = []
    for m in messages:
        if m.get("tool_calls") and (own_roles or calls_as_text):
            array = json.dumps([{"name": c["function"]["name"], "arguments": _arguments(c)} for c in m["tool_calls"]])
            if own_roles:
                out += [{"role": "assistant", "content": m["content"]}] if m.get("content") else []
                out.append({"role": GRANITE_CALL_ROLE, "content": array})
            else:
                out.append({"role": "assistant", "content": f"{m.get('content') or ''}{ARRAY_MARKERS[fmt]}{array}"})
        elif m.get("tool_calls"):
            out.append({**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
                                            for c in m["tool_calls"]]})
        elif m["role"] == "tool" and own_roles:
            out.append({"role": GRANITE_RESULT_ROLE, "content": m["content"]})
        else:
            out.append(m)
    return out


def _written_forms(text: str) -> set[str]:
    """``text`` as a template may write it: as is, or as a JSON string (ASCII-escaped or not, quotes or not)."""
    forms = {text}
    for ascii_only in (True, False):
        quoted = json.dumps(text, ensure_ascii=ascii_only)
        forms |= {quoted, quoted[1:-1]}
    return forms


def check_tool_results_reach_the_prompt(messages: list[dict], prompt: str) -> None:
    """A 400 where the chat template left a tool's result out of the prompt: a template that does not know
    OpenAI's ``tool`` role drops it without a word, and the model would answer as if the tool never ran."""
    for i, m in enumerate(messages):
        if m["role"] != "tool" or not m.get("content"):
            continue
        if not any(form in prompt for form in _written_forms(m["content"])):
            raise APIError(400, f"messages.{i}: this model's chat template leaves messages of role `tool` out of "
                                "the prompt, so the tool's result would never reach the model", param=f"messages.{i}")


def without_calls(messages: list[dict]) -> list[dict]:
    """The conversation with every earlier call taken out (their turns' text kept): a template whose prompt is the
    same without them never showed them to the model."""
    return [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]


def _arguments(call: dict) -> Any:
    arguments = call.get("function", {}).get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def parse_calls(text: str, plan: ToolPlan) -> list[dict] | None:
    """The OpenAI ``tool_calls`` a reply makes, or None when it is a plain answer (or ``tool_choice`` is none).

    Read in every format we know: the fallback's array (Mistral's and Granite's too, after their marker), one
    call object (Llama 3.1 names the arguments ``parameters``), ``<tool_call>`` blocks of JSON (Qwen2.5, Qwen3)
    or of ``<function=...>`` elements (Qwen3-Coder, ``tool_xml``), and, where the template asks for it, a Python
    list of calls (Llama 4, ``tool_pythonic``). A call to a function the request did not send is text."""
    if plan.choice == "none":
        return None
    stripped = text.strip()
    for marker in ARRAY_MARKERS.values():  # there when special tokens are kept
        stripped = stripped.removeprefix(marker).strip()
    read = tool_xml.read_calls(stripped, plan.by_name) if "<function=" in stripped else None
    if read is None and plan.fmt == PYTHONIC:
        read = tool_pythonic.read_calls(stripped, plan.by_name)
    if read:
        return [_call(name, arguments, plan) for name, arguments in read]
    found: list[Any] = []
    tagged = _TAGGED_CALL.findall(stripped)
    try:
        found = [json.loads(t) for t in tagged] if tagged else [json.loads(stripped)]
    except json.JSONDecodeError:
        return None
    if len(found) == 1 and isinstance(found[0], list):
        found = found[0]
    calls = []
    for call in found:
        if not isinstance(call, dict) or call.get("name") not in plan.names:
            return None
        calls.append(_call(call["name"], call.get("arguments", call.get("parameters", {})), plan))
    return calls or None


def split_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of a whole reply: the calls it makes, and for the tagged formats the text it wrote
    before the first ``<tool_call>`` (Qwen3-Coder's template invites reasoning there); (text, None) for a plain
    answer."""
    at = text.find(TAG) if plan.fmt in TAGGED_FORMATS else -1
    if at > 0 and text[:at].strip():
        calls = parse_calls(text[at:], plan)
        return (text[:at].rstrip(), calls) if calls else (text, None)
    calls = parse_calls(text, plan)
    return (None, calls) if calls else (text, None)


def _call(name: str, arguments: Any, plan: ToolPlan) -> dict:
    return {"id": new_call_id(plan.short_ids), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))}}


@dataclass
class CallStream(CallReader):
    """Reads the fallback's array as it streams and says, per delta, what OpenAI's chunks carry: a call's
    ``id`` and ``name`` once the name is complete, then its ``arguments`` text in fragments as they arrive.

    The grammar writes the array compactly, in schema order (``[{"name":"f","arguments":{...}},...]``), so the
    reader needs no general JSON parser: it finds each name, then follows the arguments object's depth."""

    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _in_arguments: bool = False

    _NAME = re.compile(r'\{"name":"((?:[^"\\]|\\.)*)","(?:arguments|parameters)":')

    def feed(self, text: str) -> list[dict]:
        """The ``tool_calls`` deltas for ``text``, the next piece of the reply."""
        self.buffer += text
        deltas: list[dict] = []
        while self._pos < len(self.buffer):
            if not self._in_arguments:
                match = self._NAME.search(self.buffer, self._pos)
                if match is None:
                    break
                deltas.append(self._opening(json.loads(f'"{match[1]}"')))
                self._pos, self._in_arguments, self._depth = match.end(), True, 0
                continue
            start = self._pos
            while self._pos < len(self.buffer):
                ch = self.buffer[self._pos]
                self._pos += 1
                if self._in_string:
                    if self._escaped:
                        self._escaped = False
                    elif ch == "\\":
                        self._escaped = True
                    elif ch == '"':
                        self._in_string = False
                elif ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self._depth += 1
                elif ch in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        self._in_arguments = False
                        break
            deltas.append({"index": self.calls, "function": {"arguments": self.buffer[start:self._pos]}})
            if not self._in_arguments:
                self.calls += 1
        return deltas


@dataclass
class StreamedChoice:
    """One streamed choice of a request with tools: each text delta becomes the chunk's ``content`` and/or
    ``tool_calls`` deltas. A constrained reply is all calls, read as it comes (``CallStream`` for the JSON formats,
    ``XmlCallStream`` for Qwen3-Coder's, ``PythonicCallStream`` for Llama 4's lists). Under ``auto`` a reply that
    starts like a call (``[``, ``{``, a format's tag or marker) is held until it ends, then sent as calls if it is
    one, as text if not; any other reply streams as text from its first token. In the tagged formats that text may
    be followed by calls: from a ``<tool_call>`` on, the reply is held again and sent as calls if it is calls."""

    plan: ToolPlan
    calls: CallReader = field(init=False)
    held: str = ""
    streaming_text: bool = False
    pending: str = ""  # streamed text's tail that may be the start of a tag
    tagged: str | None = None  # the reply from a tag after text on, held

    def __post_init__(self) -> None:
        readers = {QWEN_XML: tool_xml.XmlCallStream, PYTHONIC: tool_pythonic.PythonicCallStream}
        self.calls = readers.get(self.plan.fmt, CallStream)(self.plan.by_name, self.plan.short_ids)

    def feed(self, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """(content, tool_calls deltas, finish_reason) for the next delta; ``finish_reason`` on the last one."""
        reason = finish_reason
        if self.plan.constrained:
            deltas = self.calls.feed(text)
            return "", deltas, ("tool_calls" if finish_reason == "stop" and self.calls.calls else reason)
        if self.plan.choice == "none":
            return text, [], reason
        if self.streaming_text:
            return self._text(text, reason)
        self.held += text
        head = self.held.lstrip()
        maybe_call = head[:1] in ("[", "{") or any(opening.startswith(head[:len(opening)])  # it, or a prefix
                                                   for opening in _CALL_OPENINGS)
        if finish_reason is None and (not head or maybe_call):
            return "", [], None
        calls = parse_calls(self.held, self.plan) if finish_reason is not None and maybe_call else None
        if calls:
            return "", _deltas(calls), ("tool_calls" if finish_reason == "stop" else reason)
        self.streaming_text, held, self.held = True, self.held, ""
        return self._text(held, reason)

    def _text(self, text: str, reason: str | None) -> tuple[str, list[dict], str | None]:
        """Text streams on; in a tagged format, from a ``<tool_call>`` on it is held until the reply ends."""
        if self.plan.fmt not in TAGGED_FORMATS:
            return text, [], reason
        if self.tagged is None:
            pending, self.pending = self.pending + text, ""
            at = pending.find(TAG)
            if at < 0:
                keep = next((k for k in range(min(len(TAG) - 1, len(pending)), 0, -1)
                             if TAG.startswith(pending[-k:])), 0) if reason is None else 0
                self.pending = pending[len(pending) - keep:] if keep else ""
                return pending[:len(pending) - keep], [], reason
            self.tagged, text = pending[at:], pending[:at]
            if reason is None:
                return text, [], None
            before = text
        else:
            self.tagged += text
            if reason is None:
                return "", [], None
            before = ""
        calls = parse_calls(self.tagged, self.plan)
        if calls:
            return before, _deltas(calls), ("tool_calls" if reason == "stop" else reason)
        return before + self.tagged, [], reason


def _deltas(calls: list[dict]) -> list[dict]:
    return [{"index": i, **call} for i, call in enumerate(calls)]
