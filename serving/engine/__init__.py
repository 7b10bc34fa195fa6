"""Continuous-batching inference engine with a paged KV cache.

Importing this package before torch sets how OpenMP worker threads wait between parallel regions (only
where the environment does not say already; it only takes effect if torch is not loaded yet):
- ``OMP_WAIT_POLICY=PASSIVE``: with the default policy, workers spin for ~300k iterations after every region;
  on a shared host they spin against the neighbours' work and each small parallel kernel (the decode
  attention) slows down by orders of magnitude (``benchmarks/NOTEBOOK.md``, "Threads").
- ``GOMP_SPINCOUNT=100000``: a purely passive worker sleeps at once and every parallel region then pays a
  wake-up (~100 µs measured for a 512x512 GEMV that computes in ~15 µs). A decode step runs ~50 regions back
  to back, so at batch 1 that was a third of the step. A bounded spin (well under a millisecond) keeps the
  workers awake across the regions of one step and lets them sleep when the engine idles. Through HTTP on
  the 2-core host, 100k spins beat 10k and 0 at every load (batch 1, 16 and 64 streams), with the API
  process and the client on the same cores (``benchmarks/NOTEBOOK.md``, "Thread wake-ups"). The local fleet
  (several replicas on one machine, ``serving.fleet.fleet``) sets 0.

The names below load on first use (PEP 562): the light modules (``config``, ``errors``,
``sampling_params``) import without torch, so the CLI can read ``EngineConfig``'s defaults for `--help`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

from artifacts.common.lazy import lazy_exports  # noqa: E402 (after the OpenMP defaults, which must come first)

__getattr__, __all__ = lazy_exports(__name__, {
    "serving.engine.config": ["EngineConfig"],
    "serving.engine.engine": ["LLMEngine"],
    "serving.engine.errors": ["EngineDrainingError", "EngineError", "InvalidRequestError", "ModelLoadError",
                              "LoraError", "QueueFullError", "UnknownAdapterError"],
    "serving.engine.outputs": ["CompletionOutput", "EngineStats", "RequestOutput"],
    "serving.engine.sampling_params": ["SamplingParams"],
})
