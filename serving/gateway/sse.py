"""Just enough of OpenAI's server-sent events to forward a stream event by event and learn what it says.

The gateway forwards each complete event as soon as it has it (never a partial one, so it can drop the
usage event it asked for on the client's behalf). Per event it does one byte-level regex search: does this
event carry text (for time to first token and inter-token gaps)? JSON is parsed only for the rare events
that matter whole (usage, errors); the text itself is rebuilt from the kept events only when someone needs
it (a shadow comparison, or a failover that continues the partial answer).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = b"[DONE]"
# a non-empty "text" (completions) or "content" (chat delta) string, with or without spaces around ':'
_HAS_TEXT = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')
_HAS_USAGE = re.compile(rb'"usage"\s*:\s*\{')
# return_token_ids (see continuation.py): read per event with a regex, never a JSON parse on the token path
_TOKEN_IDS = re.compile(rb'"token_ids"\s*:\s*\[([\d,\s]*)\]')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids"\s*:\s*\[([\d,\s]*)\]')
_ANY_IDS = re.compile(rb',\s*"(?:prompt_)?token_ids"\s*:\s*\[[\d,\s]*\]')


class EventSplitter:
    """Feed raw bytes, get complete ``data:`` events back (the payload after ``data: ``)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        if b"\n\n" not in self._buffer:
            return []
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = []
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].strip())
        return out


@dataclass
class StreamReading:
    """What a stream said so far: its text-carrying events (kept raw), the usage block, an error."""

    events: list[bytes] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None  # when the replica sends ids (return_token_ids)
    token_ids: list[int] = field(default_factory=list)  # the answer's ids the client has been sent

    @property
    def text(self) -> str:
        """The first choice's text so far (parsed only when asked), its tool calls after it as ``calls_text``
        writes them."""
        parts: list[str] = []
        calls: dict[int, dict] = {}
        for payload in self.events:
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            for choice in event.get("choices") or []:
                if choice.get("index", 0) == 0:
                    parts.append(_choice_text(choice))
                    for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                        call = calls.setdefault(delta.get("index", 0), {"function": {"name": "", "arguments": ""}})
                        function = delta.get("function") or {}
                        call["function"]["name"] += function.get("name") or ""
                        call["function"]["arguments"] += function.get("arguments") or ""
        return "".join(parts) + (calls_text([calls[i] for i in sorted(calls)]) if calls else "")

    @property
    def chunks(self) -> int:
        return len(self.events)


def read_event(payload: bytes, reading: StreamReading) -> tuple[bool, bool]:
    """Update ``reading`` from one event; returns (carries new text, is a usage-only event)."""
    if payload == DONE:
        return False, False
    if b'token_ids"' in payload:
        _read_token_ids(payload, reading)
    if payload.startswith(b'{"error"') or (b'"error"' in payload[:40]):
        try:
            reading.error = orjson.loads(payload).get("error") or {"message": "error event"}
        except orjson.JSONDecodeError:
            reading.error = {"message": payload[:200].decode(errors="replace")}
        return False, False
    if _HAS_USAGE.search(payload) and b'"usage":null' not in payload:
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False, False
        if isinstance(event.get("usage"), dict):
            reading.usage = event["usage"]
        if not event.get("choices"):
            return False, True
    if _HAS_TEXT.search(payload):
        reading.events.append(payload)
        return True, False
    return False, False


def _read_token_ids(payload: bytes, reading: StreamReading) -> None:
    if reading.prompt_token_ids is None:
        found = _PROMPT_IDS.search(payload)
        if found:
            reading.prompt_token_ids = _ints(found.group(1))
    for found in _TOKEN_IDS.finditer(payload):
        reading.token_ids += _ints(found.group(1))


def _ints(text: bytes) -> list[int]:
    return [int(x) for x in text.split(b",") if x.strip()]


def strip_token_ids(payload: bytes) -> bytes:
    """The event without the ids the gateway asked for on the client's behalf."""
    return _ANY_IDS.sub(b"", payload) if b'token_ids"' in payload else payload


def with_public_model(payload: bytes, served: str, public: str) -> bytes:
    """The event (or body) naming the model the client asked for, not the replica's internal name: a stream
    that fails over from the canary to the champion stays one model from its first chunk to its last.
    A byte-level substitution like the rest of the token path: ``"model"`` with bare quotes is a key, never
    inside generated text (where quotes are escaped)."""
    if not served or served == public:
        return payload
    return _model_field(served).sub(b'"model":' + orjson.dumps(public), payload, count=1)


@functools.lru_cache(maxsize=32)
def _model_field(served: str) -> re.Pattern[bytes]:
    return re.compile(rb'"model"\s*:\s*"' + re.escape(served.encode()) + rb'"')


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or ""


def response_text(payload: dict[str, Any]) -> str:
    """The first choice's text of a non-streamed completion or chat completion, its tool calls after it."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    if "text" in first:
        return first.get("text") or ""
    message = first.get("message") or {}
    calls = message.get("tool_calls")
    return (message.get("content") or "") + (calls_text(calls) if isinstance(calls, list) and calls else "")


def calls_text(calls: list[dict[str, Any]]) -> str:
    """Tool calls as one JSON array of ``{"name", "arguments"}`` with the arguments parsed: what a shadow pair
    compares (as JSON: the same call with its keys in another order agrees), whatever the calls' ids."""
    out = []
    for call in calls:
        function = call.get("function") or {} if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        try:
            arguments = orjson.loads(arguments) if isinstance(arguments, str) else arguments
        except orjson.JSONDecodeError:
            pass
        out.append({"name": function.get("name"), "arguments": arguments})
    return orjson.dumps(out).decode()
