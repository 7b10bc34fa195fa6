"""Supervised fine-tuning stage: teach the chat answer format on `sft_train.jsonl` (TRL SFTTrainer + LoRA).

Each transcript becomes a conversational prompt/completion pair (all turns but the last / the last assistant
turn), so TRL puts the loss on the reply only and the model learns to end it with `<|end|>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.finetune_stage import StageContext, StageSpec, run_finetune_stage
from training.lora import keep_adapters_fp32
from training.stage_config import SFTStageConfig, StageResult, TrainingError


def _to_rows(records: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, record in enumerate(records, 1):
        messages = record["messages"]
        if (not isinstance(messages, list) or len(messages) < 2 or not all(isinstance(m, dict) for m in messages)
                or messages[-1].get("role") != "assistant"):
            raise TrainingError(f"{path}: record {i}: 'messages' must be a list of chat turns ending with the "
                                "assistant's reply")
        rows.append({"prompt": messages[:-1], "completion": messages[-1:]})
    return rows


def _build_trainer(ctx: StageContext):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**ctx.args, max_length=ctx.config.max_seq_len, packing=False, completion_only_loss=True)
    trainer = SFTTrainer(model=ctx.model, args=args, train_dataset=ctx.dataset, processing_class=ctx.tokenizer)
    keep_adapters_fp32(trainer.model, ctx.hw)
    return trainer


SFT_SPEC = StageSpec(name="sft", data_file="sft_train.jsonl", required_columns=("messages",), to_rows=_to_rows,
                     build_trainer=_build_trainer)


def run_sft(config: SFTStageConfig, model_dir: Path, data_dir: Path, output_dir: Path) -> StageResult:
    """SFT from `model_dir` (the base) on `data_dir/sft_train.jsonl`; returns the merged model in `output_dir`."""
    return run_finetune_stage(SFT_SPEC, config, model_dir, data_dir, output_dir)
