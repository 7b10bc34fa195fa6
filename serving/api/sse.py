"""A streamed answer's server-sent events: the framing, the closing ``[DONE]``, and the token ids a stream
carries when the client (our gateway) asks for ``return_token_ids``."""

from __future__ import annotations

import json
from typing import Any

from serving.api.generation import Generation, SubRequest


def sse(obj: Any) -> str:
    """One event; compact JSON, as a stream sends one per token."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class TokenIdsOut:
    """`return_token_ids` for a stream: the prompt's ids once per choice, and each chunk's new token ids.

    Tokens whose text the detokenizer still holds back (half a UTF-8 character, a possible stop string) ride
    with the next chunk that carries text, so the ids a client has seen are always the ids of the text it has
    seen: a gateway that continues from them neither repeats nor drops a token."""

    def __init__(self, enabled: bool, gen: Generation) -> None:
        self.enabled = enabled
        self.gen = gen
        self._pending: dict[int, list[int]] = {}
        self._prompt_sent: set[int] = set()

    def add(self, sub: SubRequest, token_ids: list[int]) -> None:
        if self.enabled:
            self._pending.setdefault(sub.index, []).extend(token_ids)

    def take(self, sub: SubRequest) -> dict[str, list[int]]:
        if not self.enabled:
            return {}
        return {"token_ids": self._pending.pop(sub.index, [])}

    def prompt(self, sub: SubRequest) -> dict[str, list[int]]:
        if not self.enabled or sub.index in self._prompt_sent:
            return {}
        self._prompt_sent.add(sub.index)
        return {"prompt_token_ids": list(self.gen.prompts[sub.prompt_index])}
