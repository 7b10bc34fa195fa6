"""What the API process knows of a loaded LoRA adapter (no torch here: `lifecycle serve`'s API side lists it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AdapterInfo:
    name: str  # what a request's ``model`` names to use it
    path: str  # the directory it was read from
    rank: int
    digest: str  # sha256 of its weights file

    def to_json(self) -> dict:
        return asdict(self)
