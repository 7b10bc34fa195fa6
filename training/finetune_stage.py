"""The recipe every LoRA fine-tuning stage (SFT, DPO, GRPO) follows, read top to bottom in `run_finetune_stage`.

check data → skip if finished → load model + adapters (all checks before any training) → build the TRL trainer
→ train, resuming from the newest checkpoint → save adapter → merge into a full HF dir → log to MLflow → write
the finished marker last. sft.py, dpo.py and grpo.py only say what differs: data columns and the trainer.

With `distributed.num_processes` > 1 the caller's process checks and skips as above, then launches the workers
(training.launcher); each runs this same recipe as its rank (training.ranks), the Trainer trains under DDP or
FSDP, and rank 0 alone saves, merges, logs and writes the marker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from artifacts.common.atomic import atomic_write_json, staged_directory
from artifacts.common.mlflow_batch import log_batch
from artifacts.digests import digest_json, sha256_file
from artifacts.jsonl import iter_jsonl
from training.checkpoints import (
    CHECKPOINTS_DIR,
    clear_stale_outputs,
    prepare_checkpoints,
    read_finished_marker,
    stage_fingerprint,
    training_finished,
    write_finished_marker,
)
from training.hardware import Hardware, TrainingError, configure_threads, detect_hardware, trainer_hardware_kwargs
from training.heldout_curve import attach_heldout_curve, curve_summary
from training.ranks import is_main_process, is_worker
from training.stage_config import StageResult

log = logging.getLogger(__name__)

RESULT_NAME = "stage_result.json"
LOG_NAME = "train_log.json"
WORKER_LOGS_DIR = "workers"  # a distributed stage's job file, the logs of ranks > 0 and their errors


@dataclass
class StageContext:
    """Everything a stage's trainer builder needs, gathered by `run_finetune_stage`."""

    config: Any
    hw: Hardware
    model_dir: Path
    output_dir: Path
    checkpoints_dir: Path
    tokenizer: Any
    model: Any  # PeftModel with fresh adapters
    dataset: Any  # datasets.Dataset in the trainer's format
    args: dict[str, Any]  # TrainingArguments fields common to every stage
    data_dir: Optional[Path] = None  # the data stage's dir (a stage may read its held-out files to monitor itself)
    artifacts: list[Path] = field(default_factory=list)  # extra files to log to MLflow


@dataclass
class PreparedRecords:
    """What a stage's ``prepare_records`` hook made of its data file (DPO's on-policy pairs)."""

    records: list[dict[str, Any]]
    metrics: dict[str, float] = field(default_factory=dict)
    artifacts: list[Path] = field(default_factory=list)


@dataclass
class StageSpec:
    name: str
    data_file: str
    required_columns: tuple[str, ...]
    to_rows: Callable[[list[dict[str, Any]], Path], list[dict[str, Any]]]  # validate + convert records
    build_trainer: Callable[[StageContext], Any]
    after_train: Optional[Callable[[StageContext, list[dict[str, Any]]], dict[str, float]]] = None
    # records → the records trained on, with metrics and files to log; runs after the skip check, before training
    prepare_records: Optional[Callable[[Any, Path, list[dict[str, Any]], Path, str], PreparedRecords]] = None


def load_records(data_dir: Path, spec: StageSpec, limit: int | None) -> tuple[list[dict[str, Any]], Path]:
    """Read the stage's JSONL file; a missing file or column is one TrainingError naming file and columns."""
    path = Path(data_dir) / spec.data_file
    records = []
    hint = f"{spec.name} needs this dataset file, and it does not exist"
    for lineno, record in iter_jsonl(path, TrainingError, hint):
        missing = [c for c in spec.required_columns if c not in record]
        if missing:
            raise TrainingError(
                f"{path}:{lineno}: missing column(s) {missing}; {spec.name} needs {list(spec.required_columns)}"
            )
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise TrainingError(f"{path}: no records; {spec.name} needs at least one")
    return records, path


def _conversations(row: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The whole conversations a trainer tokenizes for one row: prompt + completion (SFT), prompt + each side
    (DPO); none for GRPO, whose length limit is on the generated completion instead."""
    if "completion" in row:
        return [row["prompt"] + row["completion"]]
    if "chosen" in row:
        return [row["prompt"] + row["chosen"], row["prompt"] + row["rejected"]]
    return []


@dataclass
class LengthReport:
    """How many training conversations exceed ``max_seq_len`` and would lose their ends to truncation."""

    examples: int
    overlong: int
    longest: int
    max_seq_len: int


def measure_lengths(rows: list[dict[str, Any]], tokenizer: Any, max_seq_len: int) -> LengthReport:
    """Token length of every conversation the trainer will see, rendered with the model's chat template.

    Why: TRL truncates silently, and a reply cut before its end teaches the model never to finish it (a
    96-token limit once cut every look-alike safety reply in half, and no stage ever saw one end).
    """
    texts = [tokenizer.apply_chat_template(conversation, tokenize=False)
             for row in rows for conversation in _conversations(row)]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    return LengthReport(examples=len(lengths), overlong=sum(n > max_seq_len for n in lengths),
                        longest=max(lengths, default=0), max_seq_len=max_seq_len)


def _common_args(config: Any, hw: Hardware, checkpoints_dir: Path) -> dict[str, Any]:
    args = {
        "output_dir": str(checkpoints_dir),
        "learning_rate": config.learning_rate,
        "lr_scheduler_type": config.lr_scheduler,
        # transformers 5 has no `warmup_ratio`: a `warmup_steps` below 1 is the ratio, ceil(ratio × total steps)
        # (TrainingArguments.get_warmup_steps), and StageConfig keeps warmup_ratio in [0, 1)
        "warmup_steps": config.warmup_ratio,
        "weight_decay": config.weight_decay,
        "per_device_train_batch_size": config.distributed.per_process(config.batch_size),  # the global batch, split
        "gradient_accumulation_steps": config.grad_accum,
        "max_steps": config.max_steps if config.max_steps > 0 else -1,
        "num_train_epochs": config.epochs or 1.0,
        "logging_steps": config.logging_steps,
        "logging_first_step": True,
        "save_strategy": "steps",
        "save_steps": config.save_steps,
        "save_total_limit": 2,
        "seed": config.seed,
        "data_seed": config.seed,
        "report_to": "none",
        "remove_unused_columns": True,
        "disable_tqdm": False,
    }
    args.update(trainer_hardware_kwargs(hw))
    if config.distributed.enabled:
        args["ddp_find_unused_parameters"] = False  # every adapter weight takes part in every step
        if config.distributed.strategy == "fsdp":  # FSDP2 through accelerate's plugin, one unit per decoder layer
            args.update(fsdp=True, fsdp_config={"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                                "state_dict_type": "FULL_STATE_DICT"})
    return args


def _quiet_progress(trainer: Any) -> None:
    """Keep the trainer's progress bar but drop the raw ``{'loss': ...}`` dict it prints at every logging
    step: the same figures go to MLflow as curves, and the dicts bury the bar."""
    from transformers.trainer_callback import ProgressCallback

    class BarOnly(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            return None

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(BarOnly)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) the way the trainer will, before anything draws from them."""
    from transformers import set_seed

    set_seed(seed)


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        raise TrainingError(f"{model_dir}: the tokenizer has no chat_template; the stages train on chat data")
    return tokenizer


_SUMMARY_KEYS = ("loss", "reward", "kl", "mean_token_accuracy", "rewards/accuracies", "rewards/margins",
                 "rewards/correctness_reward/mean", "rewards/format_reward/mean", "rewards/partial_credit_reward/mean",
                 "rewards/work_reward/mean", "rewards/length_penalty/mean",
                 "completions/mean_length", "frac_reward_zero_std", "informative_group_fraction")


def _metrics_from_history(history: list[dict[str, Any]], train_output: Any) -> dict[str, float]:
    """Run totals plus the first and last logged value of the curves worth comparing."""
    metrics: dict[str, float] = {}
    for key, value in (getattr(train_output, "metrics", None) or {}).items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            metrics[key] = float(value)
    step_rows = [row for row in history if "loss" in row or "reward" in row]
    if step_rows:
        for key in _SUMMARY_KEYS:
            values = [float(row[key]) for row in step_rows if isinstance(row.get(key), (int, float))]
            if values:
                metrics[f"first_{key}"] = values[0]
                metrics[f"last_{key}"] = values[-1]
    return metrics


def _mlflow_run_id() -> str | None:
    """The run to log into: the active one (the flow's nested stage run), or in a distributed worker the
    caller's, by id (MLflow's own `MLFLOW_RUN_ID`, set by the launcher); None: log nothing."""
    import os

    import mlflow

    run = mlflow.active_run()
    if run is not None:
        return run.info.run_id
    return os.environ.get("MLFLOW_RUN_ID") if is_worker() else None


def _log_mlflow(spec: StageSpec, config: Any, result: StageResult, data_digests: dict[str, str],
                artifacts: list[Path]) -> None:
    """Log into the stage's MLflow run (`_mlflow_run_id`); nothing when there is none."""
    from mlflow.tracking import MlflowClient

    run_id = _mlflow_run_id()
    if run_id is None:
        return
    params = {f"{spec.name}.{k}": v for k, v in _flatten(config.to_dict()).items()}
    params.update({f"data.{name}.sha256": digest for name, digest in data_digests.items()})
    # Stage-prefixed keys: the flow logs its own `output_dir` param into the same run, and MLflow params are
    # write-once, so an unprefixed key would clash.
    params[f"{spec.name}.output_dir"] = str(result.output_dir)
    params[f"{spec.name}.adapter_dir"] = str(result.adapter_dir)
    curve = [(f"train/{key}", value, int(row.get("step", 0))) for row in result.log_history
             for key, value in row.items() if key not in {"step", "epoch"} and isinstance(value, int | float)]
    curve += [(key, value, 0) for key, value in result.metrics.items()]
    client = MlflowClient()
    log_batch(run_id, metrics=curve, params=params, client=client)
    client.set_tag(run_id, "training.stage", spec.name)
    client.set_tag(run_id, "training.output_dir", str(result.output_dir))
    for path in artifacts:
        if path.exists():
            client.log_artifact(run_id, str(path))


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _checkpoints_key(config: Any, fingerprint: str) -> str:
    """Checkpoints are resumed only by the same process layout that wrote them (FSDP shards its optimizer state
    per process); the completion fingerprint ignores the layout, so a finished stage stays finished."""
    if not config.distributed.enabled:
        return fingerprint
    return digest_json({"fingerprint": fingerprint, "distributed": dataclasses.asdict(config.distributed)})


def _train_in_workers(spec: StageSpec, config: Any, model_dir: Path, data_dir: Path, output_dir: Path,
                      fingerprint: str) -> StageResult:
    """Launch `config.distributed.num_processes` workers that each run this stage as their rank; rank 0 writes
    the result this returns. The checkpoints dir is prepared here, once, before any worker reads it."""
    from training.launcher import launch_workers

    output_dir.mkdir(parents=True, exist_ok=True)
    prepare_checkpoints(output_dir, _checkpoints_key(config, fingerprint))
    job = {"kind": "stage", "stage": spec.name, "config": config.to_dict(), "model_dir": str(model_dir),
           "data_dir": str(data_dir), "output_dir": str(output_dir)}
    launch_workers(job, config.distributed, detect_hardware().device, output_dir / WORKER_LOGS_DIR, spec.name)
    if not training_finished(output_dir, fingerprint):
        raise RuntimeError(f"{spec.name}: every worker exited 0 but {output_dir} has no finished marker")
    return StageResult.from_dict(json.loads((output_dir / RESULT_NAME).read_text(encoding="utf-8")))


def _adapter_state(trainer: Any) -> dict[str, Any] | None:
    """In a worker, the trained model's full state dict for rank 0 to save (under FSDP every rank must take
    part in gathering it); None in a lone process, which saves its model as it is."""
    return trainer.accelerator.get_state_dict(trainer.model_wrapped) if is_worker() else None


def run_finetune_stage(spec: StageSpec, config: Any, model_dir: Path, data_dir: Path,
                       output_dir: Path) -> StageResult:
    """Run one fine-tuning stage; see the module docstring for the order of events."""
    from training.lora import attach_adapters, load_base_model
    from training.merge import merge_adapter

    model_dir, data_dir, output_dir = Path(model_dir), Path(data_dir), Path(output_dir)
    if not config.enabled:  # switched off in the recipe: the next stage starts from this stage's input
        return StageResult(stage=spec.name, output_dir=model_dir, adapter_dir=None, skipped=True)
    if not (model_dir / "config.json").is_file():
        raise TrainingError(f"{model_dir}: no config.json, not a Hugging Face model directory")

    records, data_path = load_records(data_dir, spec, config.max_train_examples)
    data_digests = {data_path.name: sha256_file(data_path)}
    fingerprint = stage_fingerprint(spec.name, config.recipe(), model_dir, data_digests)
    if training_finished(output_dir, fingerprint) and (output_dir / RESULT_NAME).is_file():
        result = StageResult.from_dict(json.loads((output_dir / RESULT_NAME).read_text(encoding="utf-8")))
        result.skipped = True
        log.info("%s: already finished in %s, skipped", spec.name, output_dir)
        return result
    if read_finished_marker(output_dir) is not None and is_main_process():
        clear_stale_outputs(output_dir)

    prepared = PreparedRecords(records)
    if spec.prepare_records is not None:  # a worker reads back what its launching process prepared
        prepared = spec.prepare_records(config, model_dir, records, output_dir, fingerprint)
        if not prepared.records:  # e.g. DPO whose input model got every sampled reply right
            log.info("%s: nothing to train on after preparing %s; the stage keeps its input model", spec.name,
                     data_path.name)
            return StageResult(stage=spec.name, output_dir=model_dir, adapter_dir=None, skipped=True,
                               metrics=prepared.metrics)
    rows = spec.to_rows(prepared.records, data_path)
    if config.distributed.enabled and not is_worker():
        return _train_in_workers(spec, config, model_dir, data_dir, output_dir, fingerprint)
    hw = detect_hardware()
    configure_threads()
    tokenizer = _load_tokenizer(model_dir)
    # The trainer seeds the RNGs only when it is built, after the adapters exist: without this the LoRA A
    # matrices took whatever state the process was in, and one recipe trained different models run to run.
    seed_everything(config.seed)
    model = attach_adapters(load_base_model(model_dir, config.lora, hw), config.lora)  # checks targets, 4-bit
    lengths = measure_lengths(rows, tokenizer, config.max_seq_len)
    if lengths.overlong and is_main_process():
        log.warning("%s: %d of %d training conversations are longer than max_seq_len=%d tokens (longest %d) "
                    "and will be truncated; raise max_seq_len in the recipe to train on their ends", spec.name,
                    lengths.overlong, lengths.examples, lengths.max_seq_len, lengths.longest)

    output_dir.mkdir(parents=True, exist_ok=True)
    checkpoints_dir, resume_from = prepare_checkpoints(output_dir, _checkpoints_key(config, fingerprint))
    from datasets import Dataset

    ctx = StageContext(config=config, hw=hw, model_dir=model_dir, output_dir=output_dir,
                       checkpoints_dir=checkpoints_dir, tokenizer=tokenizer, model=model,
                       dataset=Dataset.from_list(rows), args=_common_args(config, hw, checkpoints_dir),
                       data_dir=data_dir, artifacts=list(prepared.artifacts))
    trainer = spec.build_trainer(ctx)
    attach_heldout_curve(trainer, config, model_dir, data_dir, tokenizer)
    _quiet_progress(trainer)
    resumed_from_step = 0
    if resume_from is not None:
        resumed_from_step = int(resume_from.name.rsplit("-", 1)[-1])
        log.info("%s: resuming from %s", spec.name, resume_from)
    started = time.monotonic()
    train_output = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    history = list(trainer.state.log_history)
    state = _adapter_state(trainer)
    if not is_main_process():  # rank 0 alone writes the adapter, the merge, the MLflow record and the marker
        return StageResult(stage=spec.name, output_dir=output_dir, adapter_dir=None, log_history=history,
                           resumed_from_step=resumed_from_step)

    adapter_dir = output_dir / "adapter"
    with staged_directory(adapter_dir, if_exists="replace") as staging:
        trainer.model.save_pretrained(str(staging), state_dict=state)
    del trainer, model, state
    merge_adapter(adapter_dir, model_dir, output_dir)  # onto the unquantized input weights, also for QLoRA

    metrics = _metrics_from_history(history, train_output)
    metrics["train_wall_seconds"] = round(time.monotonic() - started, 2)
    metrics["resumed_from_step"] = float(resumed_from_step)
    metrics.update(curve_summary(history))
    metrics.update(prepared.metrics)
    if lengths.examples:
        metrics["truncated_examples"] = float(lengths.overlong)
        metrics["longest_example_tokens"] = float(lengths.longest)
    if spec.after_train is not None:
        metrics.update(spec.after_train(ctx, history))

    result = StageResult(stage=spec.name, output_dir=output_dir, adapter_dir=adapter_dir, metrics=metrics,
                         log_history=history, resumed_from_step=resumed_from_step)
    atomic_write_json(output_dir / LOG_NAME, history)
    _log_mlflow(spec, config, result, data_digests, [output_dir / LOG_NAME, *ctx.artifacts])
    shutil.rmtree(output_dir / CHECKPOINTS_DIR, ignore_errors=True)
    atomic_write_json(output_dir / RESULT_NAME, result.to_dict())
    write_finished_marker(output_dir, fingerprint, {"stage": spec.name, "data": data_digests})  # last: finished
    return result
