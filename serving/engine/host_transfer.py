"""Moving a step's small data between host and GPU without making the host wait more than once per step.

``PinnedStaging`` sends: numpy writes into a page-locked buffer, one ``non_blocking`` copy to its device twin.
``HostReadback`` brings back: each tensor is copied into page-locked memory with ``non_blocking``, then one event
is waited on, and the values are read as lists. On a GPU a plain ``tensor.tolist()`` or ``torch.tensor(list,
device=...)`` each blocks the host until the GPU has caught up (a pageable copy), so the engine's step uses these
two instead; the count of waits is kept so tests can hold the engine to one per step. On CPU the same copies run
between host tensors, so CPU tests see what a GPU would read.

With async scheduling (``engine``) one step is in flight while the host prepares the next, so a staging buffer
written for step N+1 may still be waiting to be copied for step N. ``PinnedStaging`` therefore alternates between
two host buffers: by the time it writes one again, the step that read it has been waited on (the engine keeps at
most one step in flight). ``HostReadback.start`` begins a read back without waiting; ``PendingReadback.wait``
waits, once, when the host needs the values.
"""

from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    """Two page-locked host int32 buffers (pinned only where a GPU copies from them), used in turn, and their
    device twin, grown on demand; ``upload(n)`` sends the first ``n`` ints of the current one in one non-blocking
    copy. ``flip()`` moves to the other host buffer: call it before writing a step (``reserve`` does)."""

    def __init__(self, device: torch.device, capacity: int = 1024) -> None:
        self.device = device
        self.hosts: list[torch.Tensor] = []
        self.current = 0
        self.dev: torch.Tensor | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        pin = self.device.type == "cuda"
        self.hosts = [torch.empty(capacity, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._arrays = [h.numpy() for h in self.hosts]  # made once: a step writes through them several times
        # a twin on CPU too: a field the upload misses then reads stale values in CPU tests, as it would on a GPU
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device)

    @property
    def host(self) -> torch.Tensor:
        return self.hosts[self.current]

    @property
    def array(self) -> np.ndarray:
        """The current host buffer as numpy (the view the step's fields are written into)."""
        return self._arrays[self.current]

    def flip(self) -> None:
        """Write the next step into the other host buffer (the one the step before last used)."""
        self.current ^= 1

    def reserve(self, n: int) -> None:
        """Make room for ``n`` ints in the next host buffer (its old contents are dropped: call before writing a
        step)."""
        self.flip()
        if n > self.host.shape[0]:
            self._allocate(max(n, 2 * self.host.shape[0]))

    def upload(self, n: int) -> None:
        if n:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)


class PendingReadback:
    """Copies to the host under way; ``wait()`` blocks until they landed (the step's one wait) and returns the
    values as lists. Waiting twice returns the same lists and counts once."""

    def __init__(self, owner: HostReadback, hosts: list[torch.Tensor], done: torch.cuda.Event | None) -> None:
        self._owner = owner
        self._hosts = hosts
        self._done = done
        self._values: list[list] | None = None

    def wait(self) -> list[list]:
        if self._values is None:
            self._owner.waits += 1
            if self._done is not None:
                self._done.synchronize()
            self._values = [h.tolist() for h in self._hosts]
            self._hosts = []
        return self._values


class HostReadback:
    """Device tensors to Python lists with a single wait (see the module docstring); ``waits`` counts them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.waits = 0

    def start(self, *tensors: torch.Tensor) -> PendingReadback:
        """Begin copying ``tensors`` to the host; nothing waits until ``wait()`` on the result."""
        if self.device.type != "cuda":
            return PendingReadback(self, list(tensors), None)
        hosts = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            hosts.append(host)
        done = torch.cuda.Event()
        done.record()
        return PendingReadback(self, hosts, done)

    def fetch(self, *tensors: torch.Tensor) -> list[list]:
        """``start`` and ``wait`` at once."""
        return self.start(*tensors).wait()
