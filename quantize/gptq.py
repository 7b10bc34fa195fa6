"""GPTQ (Frantar et al., 2022) through gptqmodel: per-layer second-order rounding with error
compensation, calibrated on training-distribution text. Writes a standard GPTQ checkpoint."""

from __future__ import annotations

from pathlib import Path

from quantize.backend import run_gptqmodel
from quantize.calibration import CalibrationSet
from quantize.config import QuantizeConfig


def quantize_gptq(model_dir: Path, out_dir: Path, calibration: CalibrationSet, config: QuantizeConfig) -> Path:
    """GPTQ-quantize `model_dir` into `out_dir` (temp dir + rename); returns `out_dir`."""
    return run_gptqmodel("gptq", Path(model_dir), Path(out_dir), calibration, config)
