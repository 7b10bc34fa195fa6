"""Fold LoRA adapters into full-precision weights, giving a plain HF dir the next stage, evals and quantize load.

For QLoRA the adapters were trained over an NF4 copy of the base; they are merged onto the *unquantized* base
weights read from `base_model_dir`, so no 4-bit rounding is baked into the result.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from artifacts.common.atomic import staged_directory
from artifacts.common.quiet import import_quietly
from training.stage_config import TrainingError

# Files copied verbatim from the base so the merged dir keeps the exact tokenizer, chat template and stop ids.
_CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                  "generation_config.json")


def merge_adapter(adapter_dir: Path, base_model_dir: Path, output_dir: Path) -> Path:
    """Merge the adapter in `adapter_dir` onto the fp32 weights of `base_model_dir`; write a full HF dir.

    Files are written into a temp dir and then renamed into `output_dir` (the whole dir when it does not exist
    yet, else file by file, so a stage dir keeping its `adapter/` and checkpoints is not disturbed).
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir, base_model_dir, output_dir = Path(adapter_dir), Path(base_model_dir), Path(output_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise TrainingError(f"{adapter_dir}: no adapter_config.json, not a PEFT adapter directory")
    if not (base_model_dir / "config.json").is_file():
        raise TrainingError(f"{base_model_dir}: no config.json, not a Hugging Face model directory")

    base = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    import_quietly("gptqmodel")  # peft imports it to look for GPTQ layers, and it prints a banner on import
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.config.dtype = torch.float32

    # "merge": the stage directory also holds the adapter and the logs; its completion marker says when
    # the whole of it is done.
    with staged_directory(output_dir, if_exists="merge") as tmp:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        for name in _CARRIED_FILES:
            if (base_model_dir / name).is_file():
                shutil.copy2(base_model_dir / name, tmp / name)
    return output_dir
