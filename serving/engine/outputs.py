"""What a step computes and what the engine hands back: the model's output for a batch (vLLM v1's
``ModelRunnerOutput``), vLLM-shaped request outputs and an engine stats snapshot."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.engine.sequence import Sequence

LogprobRecord = dict[int, float]  # token id -> logprob, the chosen token first


@dataclass
class ModelOutput:
    """What one forward pass computed for a batch, keyed by index into the plan's ``scheduled``.

    It changes no sequence: ``Scheduler.update_from_output`` applies it. Keeping the two apart is what lets
    a failed batch be re-run one sequence at a time before anything is committed.
    """

    sample_flags: list[bool]  # per scheduled sequence: it samples a token this step
    # index -> (first prompt position predicted, one logprob record per position)
    prompt_records: dict[int, tuple[int, list[LogprobRecord]]] = field(default_factory=dict)
    sampled: dict[int, tuple[int, LogprobRecord | None]] = field(default_factory=dict)  # index -> (token, record)
    verified: dict[int, list[int]] = field(default_factory=dict)  # index -> the model's greedy token per row
    errors: dict[int, Exception] = field(default_factory=dict)  # index -> why it failed when run alone
    # the forward's seconds (what a draft model's passes are weighed against); None when the batch was re-run
    forward_seconds: float | None = None


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
    num_steps_overlapped: int = 0  # steps waited for while the next was already launched (async scheduling)
    spec_draft_tokens_total: int = 0  # guessed tokens checked (speculative decoding)
    spec_accepted_tokens_total: int = 0  # guessed tokens the model agreed with
    spec_draft_cost_ratio: float = 0.0  # a draft pass's cost over a target step's, as measured (0: none yet)
    # LoRA adapters: those running requests hold, those only waiting requests ask for, and the resident slots
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens_total / self.spec_draft_tokens_total if self.spec_draft_tokens_total else 0.0


def request_output(seq: Sequence, new_ids: list[int], new_lp: list[LogprobRecord] | None,
                   finished: bool) -> RequestOutput:
    """A request's state after a step. While it runs, text that may still turn out to start a stop string
    is held back (the detokenizer says how much is safe to show)."""
    detok = seq.detokenizer
    text = detok.text if detok else ""
    delta = detok.delta(finished) if detok else ""
    if detok and not finished and not detok.stopped_on:
        text = text[:detok.emitted]
    comp = CompletionOutput(0, text, seq.output_token_ids,
                            seq.logprobs if seq.params.logprobs is not None else None,
                            seq.finish_reason if finished else None, seq.stop_reason)
    return RequestOutput(seq.request_id, seq.prompt_token_ids, [comp], finished, delta, new_ids, new_lp,
                         seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
                         seq.num_cached_tokens, seq.arrival_time, seq.first_token_time,
                         time.monotonic() if finished else None)
