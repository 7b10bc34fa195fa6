"""The `distributed:` key of a training stage (SFT, DPO, GRPO, the draft): how many processes train it, and how.

Apart from the launcher so that reading a recipe imports neither torch nor accelerate. `num_processes: 1` (the
default) trains in the stage's own process, exactly as before; more launches that many worker processes
(training.launcher): one per GPU on a CUDA machine, gloo processes on a CPU. The recipe's `batch_size` stays the
*global* batch and is split evenly across the processes, so an N-process run takes the same examples per
optimizer step as one process and a recipe means the same thing whatever the process count.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("ddp", "fsdp")


@dataclass
class DistributedSettings:
    """`num_processes` workers; `strategy` ddp (a full replica each, gradients averaged) or fsdp (parameters,
    gradients and optimizer state sharded across the workers: for models that do not fit one device)."""

    num_processes: int = 1
    strategy: str = "ddp"

    def __post_init__(self) -> None:
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes: must be an integer >= 1, got {self.num_processes!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    def per_process(self, batch_size: int, what: str = "batch_size") -> int:
        """The share of a global `batch_size` each process takes; a ValueError naming the key when it does
        not split evenly (an uneven split would change what one optimizer step sees)."""
        share, rest = divmod(batch_size, self.num_processes)
        if rest or share < 1:
            raise ValueError(f"distributed.num_processes: {what} {batch_size} does not split evenly over "
                             f"{self.num_processes} processes (the recipe's {what} is the global batch)")
        return share


def distributed_settings(value: object) -> DistributedSettings:
    """The settings from a config field that YAML or JSON may have left as a plain mapping."""
    if isinstance(value, DistributedSettings):
        return value
    if isinstance(value, dict):
        return DistributedSettings(**value)
    raise ValueError(f"distributed: expected a mapping like {{num_processes: 2}}, got {value!r}")
