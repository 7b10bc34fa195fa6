import json
import math

import pytest

from quantize.calibration import load_texts
from quantize.config import QuantizeConfig
from quantize.errors import QuantizeError
from quantize.fidelity import FidelityReport, FidelityRow, fidelity_report
from quantize.pipeline import check_gate
from quantize.rtn import quantize_rtn


@pytest.fixture(scope="module")
def texts(tiny_data_dir):
    return load_texts(tiny_data_dir / "text_heldout.jsonl", limit=8)


@pytest.fixture(scope="module")
def rtn2_dir(tiny_model_dir, tmp_path_factory):
    # 2-bit per-channel rounding: coarse enough that the drift is unmistakable.
    cfg = QuantizeConfig(methods=["gptq"], bits=2, group_size=-1)
    return quantize_rtn(tiny_model_dir, tmp_path_factory.mktemp("rtn2") / "rtn", cfg)


def test_model_against_itself_is_identical(tiny_model_dir, texts):
    report = fidelity_report(tiny_model_dir, {"same": tiny_model_dir}, texts, log_to_mlflow=False)
    ref, same = report.row("reference"), report.row("same")
    assert same.kl_mean == pytest.approx(0.0, abs=1e-7)
    assert same.top1_agreement == 1.0
    assert same.perplexity == pytest.approx(ref.perplexity, rel=1e-6)
    assert same.size_bytes == ref.size_bytes > 0
    assert report.num_texts == len(texts) and report.num_tokens > len(texts)


def test_quantized_model_drifts(tiny_model_dir, rtn2_dir, texts):
    report = fidelity_report(tiny_model_dir, {"rtn2": rtn2_dir}, texts, log_to_mlflow=False)
    row = report.row("rtn2")
    assert row.kl_mean > 1e-4
    assert 0.0 <= row.top1_agreement < 1.0
    assert math.isfinite(row.perplexity) and row.perplexity != report.row("reference").perplexity
    md = report.to_markdown()
    assert md.count("\n| ") == 3 and "| rtn2 |" in md and "mean KL" in md
    data = json.loads(report.to_json())
    assert [r["name"] for r in data["rows"]] == ["reference", "rtn2"]


def test_bad_inputs(tiny_model_dir, tmp_path, texts):
    with pytest.raises(QuantizeError, match="empty"):
        fidelity_report(tiny_model_dir, {}, [], log_to_mlflow=False)
    with pytest.raises(QuantizeError, match="reserved"):
        fidelity_report(tiny_model_dir, {"reference": tiny_model_dir}, texts, log_to_mlflow=False)
    with pytest.raises(QuantizeError, match="cannot load"):
        fidelity_report(tiny_model_dir, {"nothing": tmp_path}, texts, log_to_mlflow=False)


def test_logs_to_active_mlflow_run(tiny_model_dir, rtn2_dir, texts, mlflow_tracking):
    import mlflow

    report = fidelity_report(tiny_model_dir, {"rtn2": rtn2_dir}, texts, log_to_mlflow=False)
    assert report.log_to_mlflow() is False  # no active run: nothing logged, no error
    with mlflow.start_run() as run:
        assert report.log_to_mlflow() is True
    metrics = mlflow_tracking.get_run(run.info.run_id).data.metrics
    assert metrics["fidelity.rtn2.kl_mean"] == pytest.approx(report.row("rtn2").kl_mean)
    assert metrics["fidelity.reference.top1_agreement"] == 1.0
    names = {a.path for a in mlflow_tracking.list_artifacts(run.info.run_id, "quantize")}
    assert names == {"quantize/fidelity.md", "quantize/fidelity.json"}


def _report(kls: dict[str, float]) -> FidelityReport:
    rows = [FidelityRow(name, name, kl, 10.0, 0.9, 1) for name, kl in kls.items()]
    return FidelityReport(rows=rows, num_texts=1, num_tokens=1, texts_digest="x")


def test_gate_gptq_must_beat_rtn():
    cfg = QuantizeConfig()
    assert check_gate(cfg, _report({"rtn": 1e-3, "gptq": 3e-4}))
    assert not check_gate(cfg, _report({"rtn": 1e-3, "gptq": 2e-3}))
    assert check_gate(QuantizeConfig(gate_gptq_beats_rtn=False), _report({"rtn": 1e-3, "gptq": 2e-3}))
    assert check_gate(QuantizeConfig(methods=["awq"]), _report({"rtn": 1e-3, "awq": 2e-3}))
