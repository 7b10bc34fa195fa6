"""LoRA/QLoRA set-up on the micro model, and the clear errors a bad recipe gets before training starts."""

from __future__ import annotations

import pytest
import torch

from artifacts.errors import LifecycleError
from training.hardware import detect_hardware, trainer_hardware_kwargs
from training.lora import attach_adapters, linear_module_names, load_base_model
from training.sft import run_sft
from training.stage_config import LoraSettings, SFTStageConfig, TrainingError


def test_linear_module_names_lists_llama_projections(micro_base_dir):
    model = load_base_model(micro_base_dir, LoraSettings(), detect_hardware())
    names = linear_module_names(model)
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= names
    assert "lm_head" not in names


def test_lora_adapters_are_the_only_trainable_weights(micro_base_dir):
    settings = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = attach_adapters(load_base_model(micro_base_dir, settings, detect_hardware()), settings)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("k_proj" in n for n in trainable)


def test_qlora_loads_the_base_in_nf4_and_trains_fp32_adapters_on_cpu(micro_base_dir):
    settings = LoraSettings(r=4, alpha=8, qlora=True)
    model = attach_adapters(load_base_model(micro_base_dir, settings, detect_hardware()), settings)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear4bit" in kinds
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values())
    ids = torch.tensor([[0, 5, 9, 12]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for p in trainable.values())


def test_unknown_target_module_fails_before_training(micro_base_dir, micro_data_dir, tmp_path):
    config = SFTStageConfig(max_steps=2, lora=LoraSettings(target_modules=["q_proj", "wq"]))
    with pytest.raises(TrainingError, match=r"lora.target_modules: \['wq'\] not found") as err:
        run_sft(config, micro_base_dir, micro_data_dir, tmp_path / "sft")
    assert isinstance(err.value, LifecycleError)
    assert not (tmp_path / "sft" / "checkpoints").exists()


def test_4bit_request_on_hardware_without_support_is_one_clear_error(micro_base_dir, micro_data_dir, tmp_path,
                                                                      monkeypatch):
    def no_nf4(device: str) -> None:  # injected fault: a bitsandbytes build without this device's kernels
        raise RuntimeError("no 4-bit kernels for this device")

    monkeypatch.setattr("training.hardware._nf4_round_trip", no_nf4)
    config = SFTStageConfig(max_steps=2, lora=LoraSettings(qlora=True))
    with pytest.raises(TrainingError, match="lora.qlora: 4-bit NF4 loading is not available"):
        run_sft(config, micro_base_dir, micro_data_dir, tmp_path / "sft")
    assert not (tmp_path / "sft" / "checkpoints").exists()


def test_cpu_trainer_settings_turn_off_bf16_and_checkpointing():
    hw = detect_hardware()
    kwargs = trainer_hardware_kwargs(hw)
    assert kwargs["gradient_checkpointing"] is False
    if hw.device == "cpu":
        assert kwargs["use_cpu"] and not kwargs["bf16"] and not kwargs["dataloader_pin_memory"]


@pytest.mark.parametrize("field,value", [("r", 0), ("dropout", 1.5), ("target_modules", [])])
def test_lora_settings_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        LoraSettings(**{field: value})
