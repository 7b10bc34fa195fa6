"""Greedy held-out task accuracy measured *during* a training stage, logged as a curve beside the reward.

Why: GRPO's reward is the correctness of sampled replies to its training prompts, so a rising reward can
mean a sharper policy, a memorised prompt set or a gamed shaping term. The figure a user of the chat model
sees is greedy accuracy on prompts the stage never trained on; logged every few steps (to MLflow through
the trainer's own `log`, and into the stage's plot), it shows whether and when a run earned it. The
sample is a fixed slice of `tasks_heldout.jsonl`, the same prompts at every point of the curve.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artifacts.jsonl import iter_jsonl

log = logging.getLogger(__name__)

METRIC = "heldout_greedy_accuracy"
HELDOUT_FILE = "tasks_heldout.jsonl"


@dataclass(frozen=True)
class HeldoutSample:
    """The prompts (chat messages) and reference answers the curve is measured on."""

    prompts: list[list[dict[str, str]]]
    answers: list[str]


def load_heldout_sample(data_dir: Path, size: int) -> HeldoutSample | None:
    """The first ``size`` held-out task records of the data dir; None when the file is absent (a data dir
    built for GRPO alone) or ``size`` is 0, so the stage trains without the curve instead of failing."""
    path = Path(data_dir) / HELDOUT_FILE
    if size <= 0 or not path.is_file():
        return None
    from training.stage_config import TrainingError

    records = [r for _, (_, r) in zip(range(size), iter_jsonl(path, TrainingError))]
    return HeldoutSample([[{"role": "user", "content": str(r["prompt"])}] for r in records],
                         [str(r["answer"]) for r in records])


def greedy_accuracy(model: Any, tokenizer: Any, sample: HeldoutSample, eos_ids: list[int],
                    max_new_tokens: int) -> float:
    """Greedy accuracy of the live (adapter-wrapped) model on ``sample``, restoring its train/eval mode."""
    import torch

    from evals.generation import generate_replies
    from evals.model import LoadedModel
    from evals.scoring import is_correct

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    lm = LoadedModel(model_dir=Path("."), model=model, tokenizer=tokenizer, device=device, eos_ids=list(eos_ids),
                     pad_id=int(pad), max_context=int(getattr(model.config, "max_position_embeddings", 2048)))
    prompts = [lm.chat_prompt(messages) for messages in sample.prompts]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            replies = generate_replies(lm, prompts, max_new_tokens, batch_size=len(prompts), desc="held-out curve")
    finally:
        model.train(was_training)
    return sum(is_correct(g.text, a) for g, a in zip(replies, sample.answers, strict=True)) / len(sample.answers)


def heldout_curve_callback(sample: HeldoutSample, tokenizer: Any, eos_ids: list[int], max_new_tokens: int,
                           every: int):
    """A TrainerCallback that measures ``greedy_accuracy`` before the first step, every ``every`` steps and at
    the last one, and logs it through the trainer (``bind`` it to the trainer once built)."""
    from transformers import TrainerCallback

    class HeldoutCurve(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None
            self.measured: set[int] = set()

        def bind(self, trainer: Any) -> HeldoutCurve:
            self.trainer = trainer
            return self

        def _measure(self, state: Any, control: Any) -> None:
            if self.trainer is None or state.global_step in self.measured:
                return
            self.measured.add(state.global_step)
            value = greedy_accuracy(self.trainer.model, tokenizer, sample, eos_ids, max_new_tokens)
            # Trainer.log clears `should_log` (its callback handler does, for every log call): keep the flag
            # the flow callback set for this step, or the step's own loss row is never written.
            should_log = control.should_log
            self.trainer.log({METRIC: value})
            control.should_log = should_log

        def on_train_begin(self, args, state, control, **kwargs):
            self._measure(state, control)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % every == 0 or state.global_step >= state.max_steps:
                self._measure(state, control)

    return HeldoutCurve()


# A worked 2-digit sum and its answer line is ~28 tokens; a stage without a completion limit of its own
# (SFT, DPO) measures its curve with this many new tokens.
DEFAULT_MAX_NEW_TOKENS = 32


def attach_heldout_curve(trainer: Any, config: Any, model_dir: Path, data_dir: Path | None, tokenizer: Any) -> bool:
    """Measure the held-out curve during ``trainer``'s run when the stage asks for one and the data dir holds
    held-out tasks; returns whether it was attached. Every stage gets the same curve, so SFT, DPO and GRPO can
    be read off one axis: which stage earned the skill, and when."""
    from artifacts.common.stop_tokens import stop_token_ids

    sample = load_heldout_sample(data_dir, config.heldout_curve_prompts) if data_dir is not None else None
    if sample is None:
        return False
    max_new_tokens = getattr(config, "max_completion_length", DEFAULT_MAX_NEW_TOKENS)
    curve = heldout_curve_callback(sample, tokenizer, stop_token_ids(model_dir, tokenizer), max_new_tokens,
                                   config.heldout_curve_every)
    trainer.add_callback(curve.bind(trainer))
    return True


def curve_summary(history: list[dict[str, Any]]) -> dict[str, float]:
    """First and last point of the curve in a trainer's log history (nothing when it was not measured)."""
    points = [float(row[METRIC]) for row in history if METRIC in row]
    if not points:
        return {}
    return {f"{METRIC}_first": points[0], f"{METRIC}_last": points[-1]}
