"""The engine work of one API request, as records.

An API request with ``n`` choices over ``p`` prompts becomes ``n * p`` engine requests (``SubRequest``),
gathered back into one answer or merged into one stream (``openai_serving``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class SubRequest:
    """One engine request: choice ``index`` of the answer, generated from prompt ``prompt_index``."""

    request_id: str
    index: int
    prompt_index: int
    queue: asyncio.Queue
    finished: bool = False


@dataclass
class Generation:
    """The engine work of one API request: ``n`` sub-requests for each prompt."""

    id: str  # the answer's id: cmpl-… / chatcmpl-…
    created: int
    prompts: list[list[int]]
    subs: list[SubRequest]
    model: str = ""  # what the answer's ``model`` says: the server's model, or the adapter the request named

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)
