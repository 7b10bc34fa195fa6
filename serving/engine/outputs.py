"""What the engine hands back: vLLM-shaped request outputs and an engine stats snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """State of one request after a step. ``delta_*`` is what is new since the previous output."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    # set when computing this request raised (finish_reason "error"); the server answers 500 with it
    error: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by live sequences
    prefix_cache_hits: int  # tokens found in the prefix cache
    prefix_cache_queries: int  # tokens looked up
    num_preemptions: int
    num_blocks: int
    block_size: int
    num_free_blocks: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    num_steps: int
    spec_draft_tokens_total: int = 0  # guessed tokens checked (speculative decoding)
    spec_accepted_tokens_total: int = 0  # guessed tokens the model agreed with
    spec_draft_cost_ratio: float = 0.0  # a draft pass's cost over a target step's, as measured (0: none yet)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens_total / self.spec_draft_tokens_total if self.spec_draft_tokens_total else 0.0
