"""Finishing a stream on another replica when the one answering it dies mid-answer.

The user must see one unbroken answer: the text so far, then the rest, none lost or repeated. Text is not
enough to go on from: a byte-level tokenizer's half UTF-8 character streams as U+FFFD, and re-encoding the
partial text rarely gives back the tokens that produced it, so the continuation would diverge at the seam.
So the gateway asks replicas for their token ids (``return_token_ids``, vLLM's extension, which our server
implements: the first chunk carries ``prompt_token_ids``, every chunk the ``token_ids`` it adds) and continues
from exactly those ids: a ``/v1/completions`` request whose prompt is the prompt's ids plus the answer's ids
so far, with the tokens left of the budget. For a chat client each continued event is rewritten into a chat
chunk; the whole answer keeps the id its first events carried, and the final usage counts the whole answer.
Against a replica that sends no ids (another OpenAI-compatible server), it falls back to text:
``continue_final_message`` for chat, prompt plus partial text for completions.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from serving.gateway.sse import StreamReading

# sampling fields that mean the same on /v1/completions and /v1/chat/completions
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
             "include_stop_str_in_output", "user", "model")


@dataclass
class Continuation:
    """How to read the continued stream: rewrite completion events as chat chunks, and add the tokens the
    first replica produced to the usage the second one reports."""

    path: str
    body: dict
    tokens_before: int = 0  # answer tokens the client already has (0: unknown, text continuation)
    as_chat: bool = False  # a chat stream continued through /v1/completions
    answer_id: str | None = None  # the id the client's events carried so far: the rest carries it too

    def translate(self, payload: bytes) -> bytes:
        if not (self.as_chat or self.tokens_before or self.answer_id) or payload == b"[DONE]" or \
                payload.startswith(b'{"error"'):
            return payload
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return payload
        usage = event.get("usage")
        if self.tokens_before and isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                usage["prompt_tokens"] = prompt - self.tokens_before
                usage["completion_tokens"] = completion + self.tokens_before
        if self.answer_id:
            event["id"] = self.answer_id
        if self.as_chat:
            event["object"] = "chat.completion.chunk"
            event["choices"] = [_chat_choice(c) for c in event.get("choices") or []]
        return orjson.dumps(event)


def _chat_choice(choice: dict) -> dict:
    text = choice.get("text") or ""
    out = {"index": choice.get("index", 0), "delta": {"content": text} if text else {}, "logprobs": None,
           "finish_reason": choice.get("finish_reason")}
    if "token_ids" in choice:
        out["token_ids"] = choice["token_ids"]
    return out


def continuation(path: str, body: dict, reading: StreamReading) -> Continuation | None:
    """The request that finishes the answer ``reading`` holds so far; None when it cannot be expressed."""
    if body.get("n", 1) != 1 or _held_to_tool_calls(body):
        return None  # (the completions endpoint a continuation uses has no tools to hold it to)
    if reading.prompt_token_ids is not None:
        resumed = _from_token_ids(path, body, reading)
    else:
        resumed = _from_text(path, body, reading.text, reading.chunks)
    if resumed is not None:
        resumed.answer_id = _answer_id(reading)
    return resumed


def _answer_id(reading: StreamReading) -> str | None:
    """The id of the answer so far (every event of one answer carries it)."""
    try:
        first = orjson.loads(reading.events[0]) if reading.events else None
    except orjson.JSONDecodeError:
        return None
    return first.get("id") if isinstance(first, dict) and isinstance(first.get("id"), str) else None


def _from_token_ids(path: str, body: dict, reading: StreamReading) -> Continuation:
    done = len(reading.token_ids)
    new = {name: body[name] for name in _SAMPLING if name in body}
    new.update(prompt=reading.prompt_token_ids + reading.token_ids, stream=True, return_token_ids=True,
               stream_options={"include_usage": True})
    new["max_tokens"] = None if "chat" in path else 16  # each endpoint's default when the client set none
    for name in ("max_completion_tokens", "max_tokens"):
        if isinstance(body.get(name), int):
            new["max_tokens"] = max(1, body[name] - done)
            break
    if new["max_tokens"] is not None and "max_tokens" not in body and "max_completion_tokens" not in body:
        new["max_tokens"] = max(1, 16 - done)
    if isinstance(body.get("min_tokens"), int):
        new["min_tokens"] = max(0, body["min_tokens"] - done)
    if _constrained(body):  # the grammar reads the reply so far, then holds the rest to the same format
        new.update(response_format=body["response_format"], response_prefix_tokens=done)
    return Continuation("/v1/completions", new, tokens_before=done, as_chat="chat" in path)


def _held_to_tool_calls(body: dict) -> bool:
    return bool(body.get("tools")) and (body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"),
                                                                                        dict))


def _constrained(body: dict) -> bool:
    fmt = body.get("response_format")
    return isinstance(fmt, dict) and fmt.get("type") not in (None, "text")


def _from_text(path: str, body: dict, partial: str, chunks: int) -> Continuation | None:
    if partial and _constrained(body):
        return None  # without the tokens the grammar cannot be brought to where the reply stopped
    new = dict(body)
    for name in ("max_completion_tokens", "max_tokens"):
        if isinstance(body.get(name), int):
            new[name] = max(1, body[name] - chunks)  # a chunk carries at least one token
    if not partial:
        return Continuation(path, new)
    if "chat" in path:
        new["messages"] = [*body.get("messages", []), {"role": "assistant", "content": partial}]
        new["add_generation_prompt"] = False
        new["continue_final_message"] = True
        return Continuation(path, new)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    new["prompt"] = prompt + partial
    return Continuation(path, new)
