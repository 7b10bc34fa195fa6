"""CUDA graphs for decode-only steps: the whole forward replayed as one launch per batch-size bucket.

Why: a decode step of a small model is hundreds of short kernels, and launching them one by one from Python
costs more than running them (5-10 µs of host work each, against a few µs of GPU work). A graph captured once
per bucket replays all of them with one launch. The scheme is nano-vllm's: buckets 1, 2, 4, 8, then every 16 up
to the largest batch; a step of ``n`` sequences replays the smallest bucket ``>= n``, its extra rows padding
(no KV slot, a context of length 0: the Triton kernels write nothing to the cache for them and read nothing).

What a captured step may do (the contract the tests hold it to): read only the fixed-address inputs of
``step_inputs.DecodeStaticInputs`` (refilled before every replay), launch only shape-determined work (no value
read back to the host, no allocation whose size depends on data), and write its logits to one output that the
replay overwrites. Prefill and mixed steps, and batches past the largest bucket, run eagerly.

``replay="eager"`` runs the same function on the same static inputs instead of a graph: on CPU (CI) that proves
the data flow through the static buffers and the padding rows; on a GPU it is the ``enforce_eager`` baseline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from serving.engine.scheduled_seq import ScheduledSeq
from serving.engine.step_inputs import DecodeStaticInputs, StepInputs

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, and ``max_batch`` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """One graph per bucket of ``forward`` over ``inputs`` (see the module docstring)."""

    def __init__(self, forward: Callable[[StepInputs], torch.Tensor], inputs: DecodeStaticInputs,
                 replay: str = "graph") -> None:
        if replay not in ("graph", "eager"):
            raise ValueError(f"replay: 'graph' or 'eager', got {replay!r}")
        self.forward = forward
        self.inputs = inputs
        self.replay = replay
        self.buckets = graph_buckets(inputs.max_batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def capture(self) -> None:
        """Capture every bucket, the largest first so the smaller ones fit in its memory pool."""
        if self.replay != "graph":
            return
        started = time.perf_counter()
        with torch.inference_mode():
            self._capture_all()
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        log.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1f s", len(self.buckets),
                 self.buckets[-1], self.capture_seconds)

    def _capture_all(self) -> None:
        pool = None
        for b in reversed(self.buckets):
            x = self.inputs.inputs(b)
            self.forward(x)  # warm-up: compiles the Triton kernels, creates the library handles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(x)
            pool = graph.pool()
            self._graphs[b] = (graph, out)

    def bucket(self, n: int) -> int | None:
        """The bucket a decode step of ``n`` sequences replays, or None when it is larger than every bucket."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def fits(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether this decode-only plan can replay a graph: few enough sequences, short enough contexts."""
        return self.bucket(len(scheduled)) is not None and \
            max(len(item.seq.block_table) for item in scheduled) <= self.inputs.max_blocks

    def run(self, scheduled: list[ScheduledSeq],
            before_replay: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits [len(scheduled), V] of a decode-only step that ``fits``. ``before_replay`` gets the static input
        ids once the plan is in them (the runner writes the ids the previous step sampled on the device)."""
        n = len(scheduled)
        b = self.bucket(n)
        self.inputs.fill(scheduled, b)
        if before_replay is not None:
            before_replay(self.inputs.ids)
        if self.replay == "eager":
            return self.forward(self.inputs.inputs(b))[:n]
        graph, out = self._graphs[b]
        graph.replay()
        return out[:n]
