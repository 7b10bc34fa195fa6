"""SFT stage on the micro model: a complete HF dir out, tracking into the active MLflow run, skip when done."""

from __future__ import annotations

import json
import logging
import math

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.checkpoints import FINISHED_MARKER
from training.finetune_stage import load_records, measure_lengths
from training.heldout_curve import METRIC as HELDOUT_METRIC
from training.sft import SFT_SPEC, run_sft
from training.stage_config import LoraSettings, SFTStageConfig, TrainingError

HF_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def tiny_sft(**overrides) -> SFTStageConfig:
    values = dict(max_steps=4, batch_size=4, learning_rate=5e-3, save_steps=2, logging_steps=1,
                  lora=LoraSettings(r=4, alpha=8), heldout_curve_prompts=4, heldout_curve_every=3)
    values.update(overrides)
    return SFTStageConfig(**values)


def assert_generates(model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}],
                                        add_generation_prompt=True, return_dict=True, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


@pytest.mark.slow
def test_sft_trains_merges_logs_and_skips_when_finished(micro_base_dir, micro_data_dir, tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = tmp_path / "sft"
    with mlflow.start_run() as run:
        result = run_sft(tiny_sft(), micro_base_dir, micro_data_dir, out)

    assert result.output_dir == out and result.adapter_dir == out / "adapter" and not result.skipped
    for name in HF_FILES:
        assert (out / name).is_file(), name
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / FINISHED_MARKER).is_file() and not (out / "checkpoints").exists()
    losses = [row["loss"] for row in result.log_history if "loss" in row]
    assert len(losses) >= 3 and all(math.isfinite(v) for v in losses)
    assert result.metrics["train_loss"] > 0 and result.metrics["resumed_from_step"] == 0

    base, tuned = load_file(str(micro_base_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(tuned[k].dtype == torch.float32 for k in tuned)
    assert any(not torch.equal(base[k], tuned[k]) for k in base)  # the adapters were folded in
    assert_generates(out)

    data = MlflowClient().get_run(run.info.run_id).data
    assert data.params["sft.lora.r"] == "4" and data.params["sft.output_dir"] == str(out)
    assert "data.sft_train.jsonl.sha256" in data.params
    history = MlflowClient().get_metric_history(run.info.run_id, "train/loss")
    assert len(history) == len(losses)
    # the held-out greedy curve every stage measures: before the first step, every 3 steps and at the last one
    curve = [(row["step"], row[HELDOUT_METRIC]) for row in result.log_history if HELDOUT_METRIC in row]
    assert [step for step, _ in curve] == [0, 3, 4] and all(v in (0.0, 0.25, 0.5, 0.75, 1.0) for _, v in curve)
    assert result.metrics["heldout_greedy_accuracy_first"] == curve[0][1]
    assert result.metrics["heldout_greedy_accuracy_last"] == curve[-1][1]
    logged = MlflowClient().get_metric_history(run.info.run_id, f"train/{HELDOUT_METRIC}")
    assert sorted(m.step for m in logged) == [0, 3, 4]
    mlflow.set_tracking_uri(None)

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = run_sft(tiny_sft(), micro_base_dir, micro_data_dir, out)
    assert again.skipped and again.metrics == result.metrics
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_changed_recipe_retrains_instead_of_skipping(micro_base_dir, micro_data_dir, tmp_path):
    out = tmp_path / "sft"
    run_sft(tiny_sft(max_steps=2), micro_base_dir, micro_data_dir, out)
    second = run_sft(tiny_sft(max_steps=3), micro_base_dir, micro_data_dir, out)
    assert not second.skipped and max(r["step"] for r in second.log_history) == 3


def test_one_recipe_trains_the_same_model_whatever_the_process_drew_before(micro_base_dir, micro_data_dir, tmp_path):
    """The LoRA A matrices are random: they must come from the recipe's seed, not from the process's RNG state
    (a pipeline draws from it in earlier stages; unseeded, one recipe gave SFT 0.60 and 0.78 on the same data)."""
    torch.manual_seed(123)
    first = run_sft(tiny_sft(max_steps=2), micro_base_dir, micro_data_dir, tmp_path / "a")
    torch.rand(1000)  # what an earlier stage of the process might have drawn
    second = run_sft(tiny_sft(max_steps=2), micro_base_dir, micro_data_dir, tmp_path / "b")
    a, b = (load_file(str(r.adapter_dir / "adapter_model.safetensors")) for r in (first, second))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = run_sft(tiny_sft(max_steps=2, seed=1), micro_base_dir, micro_data_dir, tmp_path / "c")
    c = load_file(str(other.adapter_dir / "adapter_model.safetensors"))
    assert any(not torch.equal(a[k], c[k]) for k in a)  # the seed is what decides


def test_disabled_stage_hands_its_input_on(micro_base_dir, micro_data_dir, tmp_path):
    result = run_sft(tiny_sft(enabled=False), micro_base_dir, micro_data_dir, tmp_path / "sft")
    assert result.skipped and result.output_dir == micro_base_dir and result.adapter_dir is None
    assert not (tmp_path / "sft").exists()


def test_dataset_without_messages_column_is_one_clear_error(micro_base_dir, tmp_path):
    (tmp_path / "sft_train.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(TrainingError, match=r"sft_train.jsonl:1: missing column\(s\) \['messages'\]"):
        run_sft(tiny_sft(), micro_base_dir, tmp_path, tmp_path / "sft")
    with pytest.raises(TrainingError, match="does not exist"):
        run_sft(tiny_sft(), micro_base_dir, tmp_path / "nowhere", tmp_path / "sft")


def test_conversations_longer_than_max_seq_len_are_reported(micro_base_dir, micro_data_dir, tmp_path, caplog):
    rows = SFT_SPEC.to_rows(*load_records(micro_data_dir, SFT_SPEC, None))
    tokenizer = AutoTokenizer.from_pretrained(str(micro_base_dir))
    full = measure_lengths(rows, tokenizer, max_seq_len=10_000)
    assert full.examples == len(rows) and full.overlong == 0 and full.longest > 40
    assert measure_lengths(rows, tokenizer, max_seq_len=full.longest).overlong == 0
    assert measure_lengths(rows, tokenizer, max_seq_len=full.longest - 1).overlong >= 1

    with caplog.at_level(logging.WARNING, logger="training.finetune_stage"):
        result = run_sft(tiny_sft(max_steps=1, max_seq_len=40), micro_base_dir, micro_data_dir, tmp_path / "sft")
    cut = measure_lengths(rows, tokenizer, max_seq_len=40).overlong
    assert cut > 0 and result.metrics["truncated_examples"] == cut
    assert result.metrics["longest_example_tokens"] == full.longest
    assert f"{cut} of {len(rows)} training conversations are longer than max_seq_len=40" in caplog.text


@pytest.mark.slow
def test_qlora_sft_runs_on_cpu_and_merges_to_full_precision(micro_base_dir, micro_data_dir, tmp_path):
    result = run_sft(tiny_sft(lora=LoraSettings(r=4, alpha=8, qlora=True)), micro_base_dir, micro_data_dir,
                     tmp_path / "qsft")
    tuned = load_file(str(result.output_dir / "model.safetensors"))
    base = load_file(str(micro_base_dir / "model.safetensors"))
    assert set(tuned) == set(base) and all(v.dtype == torch.float32 for v in tuned.values())
    assert json.loads((result.output_dir / "config.json").read_text()).get("quantization_config") is None
    assert_generates(result.output_dir)


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("learning_rate", -1.0), ("warmup_ratio", 1.0),
                                         ("lr_scheduler", "zigzag")])
def test_stage_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SFTStageConfig(**{field: value})
