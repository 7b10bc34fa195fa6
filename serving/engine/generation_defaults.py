"""The sampling defaults a model directory ships in ``generation_config.json``.

Why: a bundle carries its generation defaults (a model tuned to be sampled at 0.7 says so there), and a
request that names no temperature should get the model's, not 1.0. Like vLLM (``--generation-config
auto``), only the sampling keys are taken, each only when present, and ``do_sample`` is ignored: a
request's own value always wins, and a key the file lacks falls back to the OpenAI default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from serving.engine.errors import InvalidRequestError, ModelLoadError
from serving.engine.sampling_params import SamplingParams

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """Per-model defaults for the sampling fields a request leaves out (None: the OpenAI default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def given(self) -> dict[str, float | int]:
        """The defaults the model sets, for logs and /v1/models."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _number(path: Path, key: str, value: object, integer: bool) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelLoadError(f"{path}: {key} must be a number, got {value!r}")
    if integer:
        if value != int(value):
            raise ModelLoadError(f"{path}: {key} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def read_sampling_defaults(model_dir: Path) -> SamplingDefaults:
    """The sampling defaults of ``model_dir/generation_config.json``; none when the file is absent."""
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return SamplingDefaults()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object")
    values = {f.name: _number(path, f.name, data[f.name], integer=f.name == "top_k")
              for f in fields(SamplingDefaults) if data.get(f.name) is not None}
    try:
        SamplingParams(**values)  # out of range here would fail every request that leaves the field out
    except InvalidRequestError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return SamplingDefaults(**values)
