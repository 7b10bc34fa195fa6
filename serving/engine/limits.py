"""What a request may ask of one engine, as a record both sides of the process split can check.

The API process validates requests before they cross to the engine-core process, so a bad request is a
synchronous 400 there exactly as it is in the in-process server; the engine checks again on arrival.
Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from serving.engine.errors import InvalidRequestError
from serving.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # the context a request may use: the model's, the config's and the KV cache's
    max_num_batched_tokens: int
    chunked_prefill: bool
    max_queue: int


def validate_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    """Check a request can ever be served; returns params with ``max_tokens`` resolved."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt: must contain at least one token")
    vocab = limits.vocab_size
    if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt: token ids must be integers in [0, {vocab})")
    if params.top_k > vocab:
        raise InvalidRequestError(f"top_k: must be <= the vocabulary size {vocab} (or 0/-1 for off), "
                                  f"got {params.top_k}")
    max_len = limits.max_model_len
    if n >= max_len and not (params.max_tokens == 0 and n == max_len):
        raise InvalidRequestError(f"prompt: {n} tokens exceeds the model's maximum context length {max_len}")
    mt = params.max_tokens if params.max_tokens is not None else max_len - n
    if n + mt > max_len:
        raise InvalidRequestError(f"max_tokens: prompt ({n} tokens) + max_tokens ({mt}) exceeds the "
                                  f"maximum context length {max_len}")
    if not limits.chunked_prefill and n > limits.max_num_batched_tokens:
        raise InvalidRequestError(f"prompt: {n} tokens exceeds max_num_batched_tokens "
                                  f"{limits.max_num_batched_tokens} (chunked prefill is off)")
    if params.max_tokens != mt:
        params = replace(params, max_tokens=mt)
    return params
