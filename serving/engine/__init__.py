"""Continuous-batching inference engine with a paged KV cache.

Importing this package before torch makes OpenMP worker threads wait passively: with the default
(spinning) policy, torch threads on a shared host spin against the neighbours' work and each small
parallel kernel (the decode attention) slows down by orders of magnitude (``benchmarks/RESULTS.md``,
"Threads"). It only takes effect if torch is not loaded yet; set ``OMP_WAIT_POLICY=PASSIVE`` in the
environment to be sure.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
