"""End to end: real gptqmodel GPTQ/AWQ runs on tiny models, reloaded by plain transformers."""

import json

import pytest
import torch

from quantize.calibration import build_calibration_set
from quantize.config import QuantizeConfig
from quantize.errors import QuantizeError
from quantize.pipeline import run_quantization


def _load_and_generate(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)  # plain: what a downstream user would write
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > ids.shape[1] and int(out.max()) < model.config.vocab_size
    return model


def _assert_quantized_dir(out, source, method, cfg):
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == method and qcfg["bits"] == cfg.bits and qcfg["group_size"] == cfg.group_size
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # temp dirs renamed or removed


@pytest.mark.slow
def test_gptq_and_awq_end_to_end(tiny_model_dir, tiny_data_dir, tmp_path):
    cfg = QuantizeConfig(group_size=32, calibration_samples=16, calibration_seq_len=64, fidelity_samples=8)
    result = run_quantization(cfg, tiny_model_dir, tiny_data_dir, tmp_path / "q")
    assert set(result.outputs) == {"rtn", "gptq", "awq"}
    for method in ("gptq", "awq"):
        _assert_quantized_dir(result.outputs[method], tiny_model_dir, method, cfg)
        model = _load_and_generate(result.outputs[method])
        assert any("Linear" in type(m).__name__ and type(m).__name__ != "Linear" for m in model.modules())
    report = result.report
    assert [r.name for r in report.rows] == ["reference", "rtn", "gptq", "awq"]
    for name in ("gptq", "awq"):
        assert report.row(name).size_bytes < report.row("reference").size_bytes / 2
        assert report.row(name).quantize_seconds > 0
    assert result.gate_passed == (report.row("gptq").kl_mean < report.row("rtn").kl_mean)
    saved = json.loads((tmp_path / "q" / "quantize_result.json").read_text())
    assert saved["calibration"]["digest"] == result.calibration_digest
    assert (tmp_path / "q" / "fidelity.md").read_text() == report.to_markdown()


@pytest.mark.slow
def test_gptq_on_embedded_micro_model(micro_base_dir, micro_data_dir, tmp_path, mlflow_tracking):
    import mlflow
    from transformers import AutoTokenizer

    cfg = QuantizeConfig(methods=["gptq"], group_size=32, calibration_samples=16, calibration_seq_len=64,
                         fidelity_samples=16)
    with mlflow.start_run() as run:
        result = run_quantization(cfg, micro_base_dir, micro_data_dir, tmp_path / "q")
    data = mlflow_tracking.get_run(run.info.run_id).data
    assert data.params["quantize.calibration_digest"] == result.calibration_digest
    assert data.metrics["quantize.gate_passed"] == 1.0
    assert data.metrics["fidelity.gptq.kl_mean"] == pytest.approx(result.report.row("gptq").kl_mean)
    _assert_quantized_dir(result.outputs["gptq"], micro_base_dir, "gptq", cfg)
    _load_and_generate(result.outputs["gptq"])
    # The recipe's gate: on a trained model GPTQ's error compensation beats plain rounding.
    assert result.gate_passed
    assert result.report.row("gptq").kl_mean < result.report.row("rtn").kl_mean
    tok = AutoTokenizer.from_pretrained(micro_base_dir)
    calib = build_calibration_set(micro_data_dir, tok, cfg.calibration_samples, cfg.calibration_seq_len)
    assert result.calibration_digest == calib.digest


def test_incompatible_group_size_fails_before_work(micro_base_dir, micro_data_dir, tmp_path):
    cfg = QuantizeConfig(methods=["gptq"], group_size=1024)
    with pytest.raises(QuantizeError, match="group_size 1024 does not divide"):
        run_quantization(cfg, micro_base_dir, micro_data_dir, tmp_path / "q")
    assert not (tmp_path / "q").exists()
