"""LoRA / QLoRA set-up: load the stage's input model (full precision or 4-bit NF4) and wrap it in adapters.

Every check that can fail (unknown target modules, 4-bit on hardware that cannot serve it) runs here, before a
trainer is built, so a bad recipe costs seconds rather than a half-finished run.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from artifacts.common.quiet import import_quietly
from training.hardware import Hardware, TrainingError, check_4bit_support
from training.ranks import cuda_device_index
from training.stage_config import LoraSettings


def linear_module_names(model: nn.Module) -> set[str]:
    """Short names (last path component) of the linear layers LoRA can target, lm_head excluded."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or type(module).__name__ in {"Linear4bit", "Linear8bitLt"}:
            short = name.rsplit(".", 1)[-1]
            if short != "lm_head":
                names.add(short)
    return names


def check_target_modules(model: nn.Module, settings: LoraSettings) -> None:
    available = linear_module_names(model)
    missing = [m for m in settings.target_modules if m not in available]
    if missing:
        raise TrainingError(
            f"lora.target_modules: {missing} not found in the model; its linear layers are {sorted(available)}"
        )


def build_lora_config(settings: LoraSettings):
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def load_base_model(model_dir: Path, settings: LoraSettings, hw: Hardware, trainable: bool = True) -> nn.Module:
    """Load `model_dir` for training in fp32, its linear layers in NF4 4-bit when `settings.qlora`.

    The weights always load as fp32: where the hardware has bf16 the trainer computes in it (mixed precision,
    ``trainer_hardware_kwargs``), and a 4-bit layer computes in `hw.dtype`.

    `trainable=False` loads a frozen copy (used for an explicit reference model).
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"dtype": torch.float32}
    if settings.qlora:
        check_4bit_support(hw)
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=hw.dtype,
            bnb_4bit_use_double_quant=True,
        )
        # the 4-bit weights live on this process's device: cuda:{local_rank} in a distributed stage
        kwargs["device_map"] = {"": hw.device if hw.device == "cpu" else cuda_device_index()}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if not trainable:
        model.eval()
        for param in model.parameters():
            param.requires_grad_(False)
    return model


def attach_adapters(model: nn.Module, settings: LoraSettings):
    """Wrap `model` in fresh LoRA adapters (after `prepare_model_for_kbit_training` for a 4-bit base)."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    check_target_modules(model, settings)
    import_quietly("gptqmodel")  # peft imports it to look for GPTQ layers, and it prints a banner on import
    if settings.qlora:
        # Gradient checkpointing stays off: it only saves memory and costs ~30% time on a tiny model on CPU.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, build_lora_config(settings))


def keep_adapters_fp32(model: nn.Module, hw: Hardware) -> None:
    """Undo TRL's QLoRA bf16 cast of adapter weights when the hardware trains in fp32 (bf16 crawls on CPU)."""
    if hw.bf16:
        return
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
