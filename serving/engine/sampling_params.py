"""Per-request sampling parameters, named like vLLM's so clients and benchmarks carry over."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.engine.errors import InvalidRequestError
from serving.engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


@dataclass
class SamplingParams:
    """How one sequence is sampled and when it stops.

    ``n`` (several choices per prompt) is handled by the API layer, which adds one engine request per
    choice; the engine itself always produces one completion per request.
    ``max_tokens=0`` is allowed: the request only prefills (useful with ``prompt_logprobs`` for scoring).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # what the reply must be (``response_format``): the engine compiles it into a grammar that masks the logits
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the field when a value is out of range."""
        def bad(name: str, why: str) -> None:
            raise InvalidRequestError(f"{name}: {why}")

        if not (self.temperature >= 0.0):
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 0:
            bad("max_tokens", f"must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be in [0, {MAX_LOGPROBS}], got {v}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-2.0 <= v <= 2.0):
                bad(name, f"must be in [-2, 2], got {v}")
        if not (self.repetition_penalty > 0.0):
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        # everything below ends up in a torch int64 tensor or generator seed
        if not (0 <= self.top_k <= _INT64_MAX):
            bad("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        if self.seed is not None and not (_INT64_MIN <= self.seed <= _INT64_MAX):
            bad("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        if any(t > _INT64_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", "must fit in a signed 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
