"""Moving a step's small data between host and GPU without making the host wait more than once per step.

``PinnedStaging`` sends: numpy writes into a page-locked buffer, one ``non_blocking`` copy to its device twin.
``HostReadback`` brings back: each tensor is copied into page-locked memory with ``non_blocking``, then one event
is waited on, and the values are read as lists. On a GPU a plain ``tensor.tolist()`` or ``torch.tensor(list,
device=...)`` each blocks the host until the GPU has caught up (a pageable copy), so the engine's step uses these
two instead; the count of waits is kept so tests can hold the engine to one per step. On CPU the same copies run
between host tensors, so CPU tests see what a GPU would read.
"""

from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    """A page-locked host int32 buffer (pinned only where a GPU copies from it) and its device twin, grown on
    demand; ``upload(n)`` sends the first ``n`` ints in one non-blocking copy."""

    def __init__(self, device: torch.device, capacity: int = 1024) -> None:
        self.device = device
        self.host = self.dev = None
        self.array: np.ndarray = np.empty(0, dtype=np.int32)
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        pin = self.device.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.int32, pin_memory=pin)
        self.array = self.host.numpy()
        # a twin on CPU too: a field the upload misses then reads stale values in CPU tests, as it would on a GPU
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device)

    def reserve(self, n: int) -> None:
        """Make room for ``n`` ints (the old contents are dropped: call before writing a step)."""
        if n > self.array.shape[0]:
            self._allocate(max(n, 2 * self.array.shape[0]))

    def upload(self, n: int) -> None:
        if n:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)


class HostReadback:
    """Device tensors to Python lists with a single wait (see the module docstring); ``waits`` counts them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.waits = 0

    def fetch(self, *tensors: torch.Tensor) -> list[list]:
        self.waits += 1
        if self.device.type != "cuda":
            return [t.tolist() for t in tensors]
        hosts = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            hosts.append(host)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return [h.tolist() for h in hosts]
