"""The draft stage's config and error, apart from `training.draft` so that reading a recipe or building the
`lifecycle draft` parser imports neither torch nor transformers.

The field names are the YAML keys of the recipe's `draft:` section and the `lifecycle draft build` flags, so
every default lives here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from artifacts.errors import LifecycleError
from training.distributed_config import DistributedSettings, distributed_settings

DRAFT_RECIPE_VERSION = 1  # bump when the code changes what a recipe produces


class DraftError(LifecycleError, ValueError):
    """A draft cannot be built from these inputs; the message names the path or field and the reason.

    Also a ValueError, so that the recipe loader reports a bad ``draft:`` value with the file and key, as it
    does for every other section."""


@dataclass
class DraftConfig:
    """Recipe of a draft: how many of the target's layers it keeps and how it is distilled.

    ``threads``, ``device`` ("auto" = CUDA when available) and ``distributed`` (processes that share each step's
    batch, under DDP) change speed, not the result, so they are not part of `recipe()` (the pipeline's cache
    key)."""

    layers: int = 1  # the target's first `layers` decoder layers
    # Distillation steps; 0 keeps the plain truncated copy. Measured on the default preset (1 thread, busy 2-core
    # host): agreement 0.76 untrained, 0.87 at 100 steps (22 s), 0.90 at 200 (40 s), 0.91 at 300 (56 s).
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    temperature: float = 1.0  # softens both distributions in the KL (>1 weighs the runner-up tokens more)
    eval_tokens: int = 4096  # held-out tokens (whole documents, never trained on) that agreement is measured on
    seed: int = 0
    threads: int = 1  # measured: 1 torch thread beat 2 on the shared 2-core host (0 = leave torch's choice)
    device: str = "auto"
    distributed: DistributedSettings = field(default_factory=DistributedSettings)

    def __post_init__(self) -> None:
        for name in ("layers", "batch_size", "eval_tokens"):
            if getattr(self, name) < 1:
                raise DraftError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.steps < 0:
            raise DraftError(f"steps: must be >= 0, got {self.steps}")
        if self.seq_len < 2:
            raise DraftError(f"seq_len: must be >= 2 (a position and the one it predicts), got {self.seq_len}")
        for name in ("lr", "temperature"):
            if getattr(self, name) <= 0:
                raise DraftError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("warmup_ratio", "min_lr_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise DraftError(f"{name}: must be in [0, 1], got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise DraftError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        if self.threads < 0:
            raise DraftError(f"threads: must be >= 0, got {self.threads}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise DraftError(f"device: must be auto, cpu or cuda, got {self.device!r}")
        try:
            self.distributed = distributed_settings(self.distributed)
            self.distributed.per_process(self.batch_size)
        except ValueError as exc:
            raise DraftError(str(exc)) from None
        if self.distributed.enabled and self.distributed.strategy != "ddp":
            raise DraftError(f"distributed.strategy: the draft trains under ddp only, got "
                             f"{self.distributed.strategy!r}: a few layers of its target fit on every device, and "
                             "sharding them buys nothing")

    def recipe(self) -> dict[str, Any]:
        """Everything that changes the draft's weights (what a cache key is made of)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("threads", "device", "distributed")}
        out["recipe_version"] = DRAFT_RECIPE_VERSION
        return out
