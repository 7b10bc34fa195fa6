"""One answer to "where does this run?": the same torch code on CUDA when present, else on the CPU.

Every stage (base-model pretraining, training, quantization, evals, serving) takes a device setting that is
``"auto"`` by default; they all resolve it here so a recipe moved to a GPU host changes nothing but speed.
torch is imported inside the function, so importing this module stays as cheap as the rest of the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["pick_device"]


def pick_device(name: str | None = "auto") -> torch.device:
    """``"auto"`` (or None): CUDA when torch sees a GPU, else CPU; any other name (``"cpu"``, ``"cuda:1"``) as given."""
    import torch

    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
