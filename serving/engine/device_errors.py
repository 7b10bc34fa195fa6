"""Which failures are the device's, not a request's: those end the engine instead of one request.

Step isolation (``serving.engine.executor``) re-runs a failed batch one sequence at a time so that a bug one
request's shape triggers fails that request alone. That is wrong for a CUDA error: after a device-side
assert or an illegal memory access the CUDA context is poisoned, and every later kernel and copy in the
process fails or, worse, reads garbage. Such an error is not isolated: the engine-core process reports it and
exits with ``DEVICE_ERROR_EXIT``, the server answers what was in flight with 503 and exits non-zero, and the
fleet (a Ray actor's restart, or any supervisor) starts a fresh replica on a fresh context. An allocator
out-of-memory is not a device error: nothing is poisoned, and a batch re-run one sequence at a time may fit.
"""

from __future__ import annotations

from serving.engine.errors import EngineError

__all__ = ["DEVICE_ERROR_EXIT", "DeviceFailedError", "describe_device_error", "is_device_error"]

# the engine-core process's exit status after a device error (1 is Python's own for an uncaught exception)
DEVICE_ERROR_EXIT = 3

# text of the CUDA (and ROCm) runtime's errors as torch raises them, where it raises a plain RuntimeError
_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
            "CUBLAS_STATUS_EXECUTION_FAILED", "HIP error")


class DeviceFailedError(EngineError):
    """The device failed under the engine (a CUDA error); the server exits so the fleet replaces it."""


def is_device_error(exc: BaseException) -> bool:
    """True for a CUDA device-side failure: torch's ``AcceleratorError``, or a RuntimeError whose text is the
    CUDA runtime's, anywhere in the chain of causes; False for the allocator's out-of-memory and the rest."""
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises this for CUDA errors
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError):
            return False
        if accelerator_error is not None and isinstance(exc, accelerator_error):
            return True
        if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def describe_device_error(exc: BaseException) -> str:
    """One line for the operator: the error's first line (torch appends advice over several lines), and
    that the failing kernel may be an earlier one, since CUDA reports errors asynchronously."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return (f"device error: {type(exc).__name__}: {first} (CUDA reports errors asynchronously, so the failing "
            "kernel may be an earlier one; CUDA_LAUNCH_BLOCKING=1 pins it)")
