"""The one place that talks to gptqmodel (GPTQ and AWQ both run through it).

gptqmodel is imported lazily: the import takes ~10 s and prints a banner, and nothing else in the
pipeline needs it. It must see its environment before that first import (see `prepare_env`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from artifacts.common.atomic import staged_directory
from artifacts.common.device import pick_device
from quantize.calibration import CalibrationSet
from quantize.config import QuantizeConfig
from quantize.errors import QuantizeError
from quantize.outputs import copy_sidecars

log = logging.getLogger(__name__)


def prepare_env() -> None:
    """Environment gptqmodel reads at import time; call before anything imports it.

    On hosts with fewer than 4 cores gptqmodel's default CPU pool (1 worker) is smaller than a
    virtual pool it asks for (2) and it aborts; 2 workers works.
    """
    if (os.cpu_count() or 1) < 4:
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def _keep_logs_beside(out_dir: Path) -> None:
    """gptqmodel 7.6 writes per-layer logs to `./logs` of whatever directory the user stands in; send
    them next to the output instead (a module constant, as there is no setting for it)."""
    try:
        from gptqmodel.looper import loop_processor
    except ImportError:
        return
    if hasattr(loop_processor, "_PROJECT_LOG_DIR"):
        loop_processor._PROJECT_LOG_DIR = out_dir.parent / f"{out_dir.name}-logs"


def run_gptqmodel(
    method: str, model_dir: Path, out_dir: Path, calibration: CalibrationSet, config: QuantizeConfig
) -> Path:
    """Quantize `model_dir` with gptqmodel's `method` ('gptq' or 'awq') into `out_dir`.

    The output is gptqmodel's standard checkpoint (packed int32 weights, `quantization_config` in
    config.json, quantize_config.json), which transformers (with optimum for GPTQ), vLLM and
    auto-gptq-style loaders read. Tokenizer files and generation_config.json are copied verbatim
    from the source afterwards so the quantizer's tokenizer fix-ups never change the chat contract.
    """
    prepare_env()
    from artifacts.common.quiet import output_to_log

    # gptqmodel's banner, per-layer tables and bars go to a log beside the outputs, not the terminal
    console_log = Path(out_dir).parent / f"{method}-gptqmodel.log"
    with output_to_log(console_log, f"{method}: gptqmodel quantizing"):
        return _run_gptqmodel(method, model_dir, out_dir, calibration, config)


def _run_gptqmodel(
    method: str, model_dir: Path, out_dir: Path, calibration: CalibrationSet, config: QuantizeConfig
) -> Path:
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.config import AWQConfig, GPTQConfig

    _keep_logs_beside(Path(out_dir))

    device = pick_device().type
    common: dict[str, Any] = {"bits": config.bits, "group_size": config.group_size, "offload_to_disk": False}
    if method == "gptq":
        qconfig = GPTQConfig(
            sym=config.sym,
            desc_act=config.desc_act,
            # gptqmodel's group-aware reordering is only valid without desc_act.
            act_group_aware=not config.desc_act,
            **common,
        )
        backend = BACKEND.AUTO
        # fp32 on CPU (fp16 matmuls there are slow and less exact); fp16 on CUDA as the kernels expect.
        dtype = torch.float16 if device == "cuda" else torch.float32
    elif method == "awq":
        # Standard AWQ is zero-point (asymmetric); its torch kernel runs only in fp16/bf16.
        qconfig = AWQConfig(sym=False, desc_act=False, **common)
        backend = BACKEND.AWQ_TORCH if device == "cpu" else BACKEND.AUTO
        dtype = torch.float16
    else:
        raise QuantizeError(f"methods: unknown gptqmodel method {method!r}")

    log.info(
        "%s: quantizing %s on %s (%d-bit, group %d, %d calibration windows of %d tokens)",
        method, model_dir, device, config.bits, config.group_size, len(calibration.input_ids), calibration.seq_len,
    )
    try:
        model = GPTQModel.load(str(model_dir), qconfig, device=device, dtype=dtype)
        model.quantize(
            calibration.as_gptqmodel_examples(),
            batch_size=min(config.calibration_batch_size, len(calibration.input_ids)),
            backend=backend,
            calibration_data_min_length=1,
        )
    except (ValueError, NotImplementedError, AssertionError) as err:
        raise QuantizeError(f"{method}: gptqmodel could not quantize {model_dir}: {err}") from err
    with staged_directory(out_dir) as tmp:
        model.save(str(tmp))
        copy_sidecars(Path(model_dir), tmp)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return Path(out_dir)
