"""The quantize stage: (config, full-precision model dir, data dir, out root) -> QuantizeResult.

out_root/
  rtn/   gptq/   awq/          one model dir per method (rtn is the fake-quantized baseline)
  fidelity.md  fidelity.json   the fidelity report (also logged to the active MLflow run)
  quantize_result.json         outputs, calibration digest, timings, gate verdict
The report is written before the gate is checked, so a failed gate still leaves the evidence.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from artifacts.common.mlflow_batch import log_batch
from quantize.calibration import HELDOUT_TEXT_FILE, build_calibration_set, load_texts
from quantize.config import QuantizeConfig, check_model_compat
from quantize.errors import QuantizeError, QuantizeGateError
from quantize.fidelity import FidelityReport, fidelity_report
from quantize.rtn import quantize_rtn

log = logging.getLogger(__name__)


@dataclass
class QuantizeResult:
    outputs: dict[str, Path]  # method -> model dir ("rtn" included: the baseline)
    report: FidelityReport
    calibration_digest: str
    gate_passed: bool
    seconds: dict[str, float]


def _read_model_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise QuantizeError(f"{path}: not found; model_dir must be a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise QuantizeError(f"{path}: not valid JSON ({err.msg})") from None


def check_gate(config: QuantizeConfig, report: FidelityReport) -> bool:
    """GPTQ must beat round-to-nearest on mean KL (when the recipe asks and GPTQ was run)."""
    if not config.gate_gptq_beats_rtn or "gptq" not in config.methods:
        return True
    return report.row("gptq").kl_mean < report.row("rtn").kl_mean


def run_quantization(
    config: QuantizeConfig,
    model_dir: Path,
    data_dir: Path,
    out_root: Path,
    calibration_file: Path | None = None,
) -> QuantizeResult:
    """Quantize with every method in the recipe plus the RTN baseline, report fidelity, apply the gate.

    Calibration text is `data_dir/calibration.jsonl` unless `calibration_file` (a user's JSONL of
    {"text"}) is given; fidelity is measured on `data_dir/text_heldout.jsonl`.
    """
    model_dir, data_dir, out_root = Path(model_dir), Path(data_dir), Path(out_root)
    check_model_compat(config, _read_model_config(model_dir), source=str(model_dir / "config.json"))
    # Heavy imports only after the cheap checks, so a bad recipe fails at once.
    from transformers import AutoTokenizer

    from quantize.awq import quantize_awq
    from quantize.gptq import quantize_gptq

    texts = load_texts(data_dir / HELDOUT_TEXT_FILE, limit=config.fidelity_samples)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calibration = build_calibration_set(
        calibration_file or data_dir, tokenizer, config.calibration_samples, config.calibration_seq_len
    )

    runners = {"gptq": quantize_gptq, "awq": quantize_awq}
    outputs: dict[str, Path] = {}
    seconds: dict[str, float] = {}
    for method in ["rtn", *config.methods]:
        log.info("quantize: stage %s", method)
        start = time.perf_counter()
        if method == "rtn":
            outputs[method] = quantize_rtn(model_dir, out_root / method, config)
        else:
            outputs[method] = runners[method](model_dir, out_root / method, calibration, config)
        seconds[method] = time.perf_counter() - start
        log.info("quantize: %s done in %.1f s -> %s", method, seconds[method], outputs[method])

    log.info("quantize: stage fidelity (%d held-out texts)", len(texts))
    report = fidelity_report(model_dir, outputs, texts, max_length=config.calibration_seq_len, log_to_mlflow=False)
    for row in report.rows:
        row.quantize_seconds = seconds.get(row.name)
    report.extra = {"calibration_digest": calibration.digest, "calibration_windows": len(calibration.input_ids)}
    report.notes = [
        (
            f"{config.bits}-bit, group size {config.group_size}; calibration: {len(calibration.input_ids)} windows "
            f"of <= {calibration.seq_len} tokens ({calibration.num_tokens} tokens, digest {calibration.digest[:12]})"
        ),
        "rtn = round-to-nearest baseline on the same grid, stored fake-quantized in fp32 (its size is the fp32 size)",
    ]
    gate_passed = check_gate(config, report)
    report.log_to_mlflow()
    _log_run(config, calibration.digest, seconds, gate_passed)
    (out_root / "fidelity.md").write_text(report.to_markdown())
    (out_root / "fidelity.json").write_text(report.to_json())
    summary = {
        "config": asdict(config),
        "model_dir": str(model_dir),
        "outputs": {k: str(v) for k, v in outputs.items()},
        "calibration": {
            "digest": calibration.digest,
            "source": str(calibration.source),
            "source_sha256": calibration.source_sha256,
            "windows": len(calibration.input_ids),
            "seq_len": calibration.seq_len,
        },
        "seconds": seconds,
        "gate_passed": gate_passed,
    }
    (out_root / "quantize_result.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not gate_passed:
        raise QuantizeGateError(
            f"gate gate_gptq_beats_rtn: GPTQ mean KL {report.row('gptq').kl_mean:.3e} is not below "
            f"RTN mean KL {report.row('rtn').kl_mean:.3e} (report: {out_root / 'fidelity.md'})"
        )
    return QuantizeResult(outputs, report, calibration.digest, gate_passed, seconds)


def _log_run(config: QuantizeConfig, calibration_digest: str, seconds: dict[str, float], gate_passed: bool) -> None:
    """Recipe, calibration digest, timings and the gate verdict into the active MLflow run (one batch)."""
    import mlflow
    run = mlflow.active_run()
    if run is None:
        return
    params = {f"quantize.{k}": v for k, v in asdict(config).items()}
    params["quantize.calibration_digest"] = calibration_digest
    metrics = {f"quantize.seconds.{k}": v for k, v in seconds.items()}
    metrics["quantize.gate_passed"] = float(gate_passed)
    log_batch(run.info.run_id, metrics=metrics, params=params)
