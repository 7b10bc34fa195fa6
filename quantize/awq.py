"""AWQ (Lin et al., 2023) through gptqmodel: per-channel scales searched on calibration
activations protect salient weights before zero-point rounding. Writes a standard AWQ GEMM
checkpoint. On CPU gptqmodel's AWQ runs in fp16 (its torch kernel's only float type here); the
fidelity report reloads it in fp32 like the others."""

from __future__ import annotations

from pathlib import Path

from quantize.backend import run_gptqmodel
from quantize.calibration import CalibrationSet
from quantize.config import QuantizeConfig


def quantize_awq(model_dir: Path, out_dir: Path, calibration: CalibrationSet, config: QuantizeConfig) -> Path:
    """AWQ-quantize `model_dir` into `out_dir` (temp dir + rename); returns `out_dir`."""
    return run_gptqmodel("awq", Path(model_dir), Path(out_dir), calibration, config)
