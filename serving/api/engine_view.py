"""The engine as the handlers see it from the API process when it steps in its own process.

``EngineView`` has the fields of ``LLMEngine`` the handlers read (tokenizer, sampling defaults, context
length, stats) without the engine in this process: the limits and stats come from the core process through
its ``ProcessEngineClient``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.api.process_engine_client import ProcessEngineClient
from serving.engine.errors import InvalidRequestError
from serving.engine.generation_defaults import SamplingDefaults, read_sampling_defaults
from serving.engine.limits import RequestLimits
from serving.engine.outputs import EngineStats


@dataclass
class EngineView:
    """The engine as the handlers see it from the API process (the fields of ``LLMEngine`` they read)."""

    tokenizer: Any
    sampling_defaults: SamplingDefaults
    limits: RequestLimits
    client: ProcessEngineClient

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt: this model has no tokenizer; send token ids")
        return self.tokenizer.encode(prompt)

    def stats(self) -> EngineStats:
        return self.client.last_stats

    @classmethod
    def load(cls, model_dir: Path, client: ProcessEngineClient) -> EngineView:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError):
            tokenizer = None  # token-id-only serving, as in the engine
        return cls(tokenizer, read_sampling_defaults(model_dir), client.limits, client)
