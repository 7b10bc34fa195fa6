"""The engine's ``SamplingParams`` for each choice of a request, with the model's generation defaults."""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.api.errors import engine_api_error
from serving.engine import InvalidRequestError, SamplingParams
from serving.engine.generation_defaults import SamplingDefaults
from serving.engine.structured_output import StructuredOutput


def _pick(requested: Any, model_default: Any, openai_default: Any) -> Any:
    """The request's value, else the model's generation_config.json default, else OpenAI's."""
    if requested is not None:
        return requested
    return openai_default if model_default is None else model_default


class SamplingFactory:
    """SamplingParams for each choice (choice i samples with seed + i); ``n`` choices, n engine requests."""

    def __init__(self, req: Any, defaults: SamplingDefaults, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None, structured: StructuredOutput | None = None) -> None:
        self.req, self.n, self.defaults = req, req.n, defaults
        self.max_tokens, self.logprobs, self.prompt_logprobs = max_tokens, logprobs, prompt_logprobs
        # a format the handler imposes (calls a request's tool_choice requires) goes before the request's own
        self.structured = structured or structured_output(req.response_format, req.response_prefix_tokens)
        try:
            self(0)  # validate once up front
        except InvalidRequestError as e:
            raise engine_api_error(e) from e

    def __call__(self, choice: int) -> SamplingParams:
        req, d = self.req, self.defaults
        stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
        return SamplingParams(
            temperature=_pick(req.temperature, d.temperature, 1.0), top_p=_pick(req.top_p, d.top_p, 1.0),
            top_k=_pick(req.top_k, d.top_k, 0), min_p=_pick(req.min_p, d.min_p, 0.0),
            max_tokens=self.max_tokens, min_tokens=req.min_tokens,
            stop=stop, stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
            seed=req.seed + choice if req.seed is not None else None,
            logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=_pick(req.repetition_penalty, d.repetition_penalty, 1.0),
            skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
            structured=self.structured)


def structured_output(fmt: Any, prefix_tokens: int = 0) -> StructuredOutput | None:
    """The engine's form of a request's ``response_format`` (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    spec = (StructuredOutput("json_object") if fmt.type == "json_object"
            else StructuredOutput.json_schema(fmt.json_schema.schema_))
    return dataclasses.replace(spec, prefix_tokens=prefix_tokens)
