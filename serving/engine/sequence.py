"""The per-request record the scheduler, block manager and runner share."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from serving.engine.detokenizer import IncrementalDetokenizer
    from serving.engine.lora import LoraAdapter


# the id a launched step's sampled token holds in ``Sequence.token_ids`` until its value comes back from the device;
# the next step's input reads the value on the device (``model_runner.TokenFill``), never this
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request being generated.

    ``token_ids`` is prompt + output so far. ``num_computed_tokens`` counts tokens whose KV is in the
    cache; the next step computes ``token_ids[num_computed_tokens:]`` (or a chunk of it). Preemption by
    recompute resets it to 0 and frees the block table; the token ids (prompt and output) are kept.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # chained hashes of the full blocks at the head of block_table (prefix caching)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    # logprob records: one dict {token_id: logprob} per output token (sampled token first)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # prompt_logprobs[i] is the record for prompt token i (None for the first one)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # per-sequence torch.Generator when a seed is given (created by the sampler on first use)
    generator: object = None
    # guessed tokens at the end of token_ids, pending the check of this step (speculative decoding)
    draft_token_ids: list[int] = field(default_factory=list)
    # the request's text so far and its stop strings (None when the model has no tokenizer)
    detokenizer: IncrementalDetokenizer | None = None
    # the parser state of a constrained reply (``response_format``; serving.engine.structured_output)
    grammar: object = None
    # the LoRA adapter the request asked for (None: the base), and its slot while the request runs
    lora: LoraAdapter | None = None
    lora_slot: int = -1
    # how many ids at the end of token_ids are PLACEHOLDERs: tokens sampled by a launched step whose values are
    # still on the device (async scheduling; the step's result writes them in, in order)
    num_pending: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def hash_root(self) -> int:
        """Where this sequence's chain of prefix-cache hashes starts: one adapter's KV is not another's."""
        return -1 if self.lora is None else hash(("lora", self.lora.digest))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_prefill(self) -> bool:
        """True while more than one token remains to be computed (the prompt, or after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1
