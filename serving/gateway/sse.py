"""Just enough of OpenAI's server-sent events to forward a stream event by event and read what it says.

The gateway forwards each complete event as soon as it has it (never a partial one, so it can drop the
usage event it asked for on the client's behalf), and reads from each its text and usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = b"[DONE]"


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
    """What a stream said so far: the first choice's text, the usage block, an error if one came."""

    text_parts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def read_event(payload: bytes, reading: StreamReading) -> tuple[bool, bool]:
    """Update ``reading`` from one event; returns (carries new text, is a usage-only event)."""
    if payload == DONE:
        return False, False
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False, False
    if not isinstance(event, dict):
        return False, False
    if "error" in event:
        reading.error = event["error"]
        return False, False
    choices = event.get("choices") or []
    if event.get("usage") is not None:
        reading.usage = event["usage"]
        if not choices:
            return False, True
    new_text = False
    for choice in choices:
        if choice.get("index", 0) != 0:
            new_text = new_text or bool(_choice_text(choice))
            continue
        text = _choice_text(choice)
        if text:
            reading.text_parts.append(text)
            new_text = True
        if choice.get("finish_reason"):
            reading.finish_reason = choice["finish_reason"]
    return new_text, False


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or ""


def response_text(payload: dict[str, Any]) -> str:
    """The first choice's text of a non-streamed completion or chat completion."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    if "text" in first:
        return first.get("text") or ""
    return ((first.get("message") or {}).get("content")) or ""
