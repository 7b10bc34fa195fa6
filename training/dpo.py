"""Direct preference optimisation stage on `pref_train.jsonl` (TRL DPOTrainer + LoRA).

The reference model is the stage's input model: TRL computes reference log-probs with the LoRA adapters
switched off, so no second copy of the weights is loaded. With ``pairs: on_policy`` the file gives the prompts
and references, and the pairs are the input model's own replies (training/on_policy_pairs.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.finetune_stage import PreparedRecords, StageContext, StageSpec, run_finetune_stage
from training.lora import keep_adapters_fp32
from training.stage_config import DPOStageConfig, StageResult, TrainingError

_COLUMNS = ("prompt", "chosen", "rejected")


def _is_turns(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "content" in m for m in value)


def _to_rows(records: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, record in enumerate(records, 1):
        if not all(_is_turns(record[c]) for c in _COLUMNS):
            raise TrainingError(f"{path}: record {i}: 'prompt', 'chosen' and 'rejected' must be lists of chat "
                                "turns (TRL conversational preference format)")
        rows.append({c: record[c] for c in _COLUMNS})
    return rows


def _build_trainer(ctx: StageContext):
    from trl import DPOConfig, DPOTrainer

    cfg: DPOStageConfig = ctx.config
    losses = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, cfg.sft_weight]} if cfg.sft_weight else {}
    args = DPOConfig(**ctx.args, beta=cfg.beta, max_length=cfg.max_seq_len, **losses)
    trainer = DPOTrainer(model=ctx.model, ref_model=None, args=args, train_dataset=ctx.dataset,
                         processing_class=ctx.tokenizer)
    keep_adapters_fp32(trainer.model, ctx.hw)
    return trainer


def _prepare_records(config: DPOStageConfig, model_dir: Path, records: list[dict[str, Any]], output_dir: Path,
                     fingerprint: str) -> PreparedRecords:
    if config.pairs != "on_policy":
        return PreparedRecords(records)
    from training.on_policy_pairs import PAIRS_FILE, mined_pairs

    pairs, report = mined_pairs(config, model_dir, records, output_dir, fingerprint)
    return PreparedRecords(pairs, report.metrics(), [Path(output_dir) / PAIRS_FILE])


DPO_SPEC = StageSpec(name="dpo", data_file="pref_train.jsonl", required_columns=_COLUMNS, to_rows=_to_rows,
                     build_trainer=_build_trainer, prepare_records=_prepare_records)


def run_dpo(config: DPOStageConfig, model_dir: Path, data_dir: Path, output_dir: Path) -> StageResult:
    """DPO from `model_dir` (SFT's output; also the reference model) on `data_dir/pref_train.jsonl`."""
    return run_finetune_stage(DPO_SPEC, config, model_dir, data_dir, output_dir)
