"""What a request may cost in tokens, and the requests whose cost can never be met.

The rate limiter reserves a request's cost up front (a tokenizer-free prompt estimate + ``max_tokens``), as
the shadow mirror does. A request that can never fit is refused here with a 400 that says why, before
anything is reserved: one whose ``max_tokens`` alone fills the model's context, or whose cost is more than its
key's whole token budget per minute. A 429 would tell the client to retry what can never succeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serving.gateway.errors import GatewayError

_COMPLETION_FIELDS = ("max_completion_tokens", "max_tokens")  # the first one given counts, as on our server


@dataclass(frozen=True)
class TokenCost:
    """A request's estimated tokens: its prompt, and the most it may generate."""

    prompt: int
    completion: int
    field: str | None  # the field ``completion`` was read from; None: the gateway's default for the route

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def token_cost(body: dict, path: str, default_chat_max_tokens: int) -> TokenCost:
    """The cost the gateway reserves; ``max_tokens`` as JSON may send it (``1e9`` is a whole number too)."""
    for name in _COMPLETION_FIELDS:
        value = body.get(name)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return TokenCost(estimate_prompt_tokens(body), value, name)
    default = 16 if path.endswith("/completions") and "chat" not in path else default_chat_max_tokens
    return TokenCost(estimate_prompt_tokens(body), default, None)


def refuse_what_never_fits(cost: TokenCost, path: str, context: int | None, budget_per_minute: float | None) -> None:
    """Raise a 400 for a request no replica and no wait can serve; ``None`` for what the gateway does not
    know (no replica has said its context; a gateway without keys has no budget)."""
    if context is not None and cost.field is not None and cost.completion >= context:
        raise GatewayError(400, f"{cost.field}: {cost.completion} leaves no room for the prompt in the model's "
                                f"maximum context length of {context} tokens (prompt + {cost.field} must fit in it)",
                           param=cost.field)
    if budget_per_minute is not None and cost.total > budget_per_minute:
        prompt_field = "messages" if "chat" in path else "prompt"
        blamed = (cost.field or "max_tokens") if cost.completion >= cost.prompt else prompt_field
        raise GatewayError(400, f"{blamed}: this request reserves {cost.total} tokens (prompt about {cost.prompt} "
                                f"+ up to {cost.completion} generated), more than this key's whole budget of "
                                f"{budget_per_minute:g} tokens per minute, so no wait would admit it",
                           param=blamed)


def estimate_prompt_tokens(body: dict) -> int:
    """A tokenizer-free estimate (about 4 characters per token, as OpenAI documents for English).

    Total over any JSON shape: a field of the wrong type counts as nothing here (the request is validated
    elsewhere), so a malformed body can never make the estimate raise."""
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                chars += len(item)
            elif isinstance(item, int):
                chars += 4
            elif isinstance(item, list):
                chars += 4 * len(item)
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content) + 16
        elif isinstance(content, list):
            chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            chars += 16
    return max(1, math.ceil(chars / 4))
