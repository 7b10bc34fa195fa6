"""Continuous-batching inference engine with a paged KV cache.

Importing this package before torch makes OpenMP worker threads wait passively: with the default
(spinning) policy, torch threads on a shared host spin against the neighbours' work and each small
parallel kernel (the decode attention) slows down by orders of magnitude (``benchmarks/RESULTS.md``,
"Threads"). It only takes effect if torch is not loaded yet; set ``OMP_WAIT_POLICY=PASSIVE`` in the
environment to be sure.

The names below load on first use (PEP 562): the light modules (``config``, ``errors``,
``sampling_params``) import without torch, so the CLI can read ``EngineConfig``'s defaults for `--help`.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_EXPORTS = {
    "EngineConfig": "serving.engine.config",
    "LLMEngine": "serving.engine.engine",
    "EngineDrainingError": "serving.engine.errors",
    "EngineError": "serving.engine.errors",
    "InvalidRequestError": "serving.engine.errors",
    "ModelLoadError": "serving.engine.errors",
    "QueueFullError": "serving.engine.errors",
    "CompletionOutput": "serving.engine.outputs",
    "EngineStats": "serving.engine.outputs",
    "RequestOutput": "serving.engine.outputs",
    "SamplingParams": "serving.engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'serving.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
