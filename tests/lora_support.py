"""Real PEFT LoRA adapters of a test model, for the engine, serving, bundle and training tests.

PEFT starts every B at zero, which would make an adapter the base itself; the B matrices here are drawn at
random (seeded), so an adapter changes the model's answers and a test comparing them proves something.
"""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(base_dir: Path, out: Path, *, rank: int, targets: list[str] | tuple[str, ...], seed: int,
                 rslora: bool = False, alpha: float | None = None, scale: float = 0.3) -> Path:
    """A PEFT adapter of ``base_dir`` saved to ``out`` (``save_pretrained``): B ~ N(0, scale²), A as PEFT
    initialises it; ``alpha`` defaults to twice the rank."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha,
                                            target_modules=list(targets), lora_dropout=0.0, use_rslora=rslora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft.save_pretrained(out)
    return out
