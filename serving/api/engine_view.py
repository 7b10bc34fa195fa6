"""The engine as the handlers see it from the API process when it steps in its own process.

``EngineView`` has the fields of ``LLMEngine`` the handlers read (tokenizer, sampling defaults, context
length, stats) without the engine in this process: the limits and stats come from the core process through
its ``ProcessEngineClient``.
"""

from __future__ import annotations

import functools
import importlib
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
        tokenizer = load_tokenizer(model_dir, client.tokenizer_class) if client.tokenizer_class else None
        return cls(tokenizer, read_sampling_defaults(model_dir), client.limits, client)


def load_tokenizer(model_dir: Path, class_path: str) -> Any:
    """The tokenizer the engine core loaded, by the class its ``AutoTokenizer`` chose (``module:qualname``).

    Why not ``AutoTokenizer`` here too: it reads the model's config through transformers' configuration
    modules, which import torch: 7 s of a server's start on the 2-core host, in a process that never runs a
    tensor op. The concrete class imports in ~1.5 s without torch and loads the same files the same way
    (``AutoTokenizer.from_pretrained`` ends in this very call). A class that cannot be imported here (a
    tokenizer from a model's own code) falls back to ``AutoTokenizer``."""
    module_name, _, qualname = class_path.partition(":")
    try:
        tokenizer_class = functools.reduce(getattr, qualname.split("."), importlib.import_module(module_name))
    except (ImportError, AttributeError):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer_class.from_pretrained(str(model_dir))
