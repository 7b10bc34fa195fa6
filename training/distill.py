"""Knowledge distillation of a student from a teacher on a packed token stream, and the figure that judges it.

Why these pieces: a speculative draft pays only where its greedy token equals the target's, so the student
learns from the teacher's whole next-token distribution (KL(teacher ‖ student), softened by a temperature:
how the teacher ranks the runner-up tokens is what a smaller model can pick up, Hinton et al. 2015), and the
figure of merit is *agreement*, the share of positions where the two argmaxes coincide, measured on text
the student never trained on. The loop is the pretraining loop of `training.base_model` with the teacher's
logits as targets: random windows of the stream, AdamW, linear warm-up then cosine decay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from training.base_model import warmup_cosine_lr
from training.window_training import WindowSchedule, train_on_windows

if TYPE_CHECKING:
    from training.draft_config import DraftConfig

__all__ = ["Agreement", "distill", "distillation_loss", "measure_agreement"]


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher ‖ student) of the next-token distributions at ``temperature``, averaged over positions.

    Scaled by T² so the gradient's size does not shrink as the temperature softens both distributions."""
    vocab = student_logits.shape[-1]
    log_q = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * temperature**2


@dataclass(frozen=True)
class Agreement:
    """How close the student is to the teacher on held-out windows, per position."""

    rate: float  # share of positions where both argmaxes are the same token: what speculation keeps
    kl: float  # mean KL(teacher ‖ student) at temperature 1, in nats
    positions: int


@torch.no_grad()
def measure_agreement(teacher: Any, student: Any, windows: torch.Tensor, batch_size: int) -> Agreement:
    """Compare the two models' next-token predictions at every position of ``windows`` ([n, length] ids)."""
    device = next(student.parameters()).device
    was_training = student.training
    student.eval()
    same, kl, positions = 0, 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        t = teacher(input_ids=chunk, use_cache=False).logits.float()
        s = student(input_ids=chunk, use_cache=False).logits.float()
        same += int((t.argmax(-1) == s.argmax(-1)).sum())
        kl += float(distillation_loss(s, t, 1.0)) * chunk.numel()
        positions += chunk.numel()
    student.train(was_training)
    return Agreement(rate=same / positions if positions else 0.0, kl=kl / positions if positions else 0.0,
                     positions=positions)


def distill(teacher: Any, student: Any, stream: torch.Tensor, config: DraftConfig,
            device: torch.device) -> dict[str, Any]:
    """Train ``student`` towards ``teacher`` for ``config.steps`` steps on random windows of ``stream``.

    Returns the loss curve (``step``, ``loss``, ``lr``: running means between log points) and the timing."""
    teacher.eval()
    warmup = round(config.warmup_ratio * config.steps)
    schedule = WindowSchedule(steps=config.steps, batch_size=config.batch_size, seq_len=config.seq_len,
                              lr=config.lr, weight_decay=config.weight_decay, seed=config.seed, log_points=50,
                              label=f"distill {config.layers}-layer draft", loss_name="kl")

    def kl_to_teacher(trained: Any, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = teacher(input_ids=batch, use_cache=False).logits
        return distillation_loss(trained(input_ids=batch, use_cache=False).logits, target, config.temperature)

    def lr_at(step: int) -> float:
        return warmup_cosine_lr(step, lr=config.lr, steps=config.steps, warmup_steps=warmup,
                                min_lr_ratio=config.min_lr_ratio)

    return train_on_windows(student, stream, schedule, kl_to_teacher, lr_at, device)
