"""Continuous-batching inference engine with a paged KV cache (see DESIGN.md, "The engine")."""

from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.errors import (
                                   EngineDrainingError,
                                   EngineError,
                                   InvalidRequestError,
                                   ModelLoadError,
                                   QueueFullError,
)
from serving.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from serving.engine.sampling_params import SamplingParams

__all__ = [
                                   "CompletionOutput",
                                   "EngineConfig",
                                   "EngineDrainingError",
                                   "EngineError",
                                   "EngineStats",
                                   "InvalidRequestError",
                                   "LLMEngine",
                                   "ModelLoadError",
                                   "QueueFullError",
                                   "RequestOutput",
                                   "SamplingParams",
]
