"""Knowledge distillation of a student from a teacher on a packed token stream, and the figure that judges it.

Why these pieces: a speculative draft pays only where its greedy token equals the target's, so the student
learns from the teacher's whole next-token distribution (KL(teacher ‖ student), softened by a temperature:
how the teacher ranks the runner-up tokens is what a smaller model can pick up, Hinton et al. 2015), and the
figure of merit is *agreement*, the share of positions where the two argmaxes coincide, measured on text
the student never trained on. The loop is the pretraining loop of `training.base_model` with the teacher's
logits as targets: random windows of the stream, AdamW, linear warm-up then cosine decay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from training.base_model import warmup_cosine_lr

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
    student.train()
    decay = [p for p in student.parameters() if p.dim() >= 2]
    no_decay = [p for p in student.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95))
    warmup = round(config.warmup_ratio * config.steps)
    generator = torch.Generator().manual_seed(config.seed)
    offsets = torch.arange(config.seq_len)
    log_every = max(1, config.steps // 50)
    steps, losses, lrs = [], [], []
    running, count, tokens = 0.0, 0, 0
    use_bf16 = device.type == "cuda"
    start = time.perf_counter()
    bar = tqdm(range(config.steps), desc=f"distill {config.layers}-layer draft", unit="step", mininterval=2.0)
    for step in bar:
        lr = warmup_cosine_lr(step, lr=config.lr, steps=config.steps, warmup_steps=warmup,
                              min_lr_ratio=config.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(stream) - config.seq_len + 1, (config.batch_size,), generator=generator)
        batch = stream[starts[:, None] + offsets].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
            with torch.no_grad():
                target = teacher(input_ids=batch, use_cache=False).logits
            loss = distillation_loss(student(input_ids=batch, use_cache=False).logits, target, config.temperature)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.item()
        count += 1
        tokens += batch.numel()
        if (step + 1) % log_every == 0 or step + 1 == config.steps:
            steps.append(step + 1)
            losses.append(running / count)
            lrs.append(lr)
            bar.set_postfix(kl=f"{running / count:.3f}", tok_s=f"{tokens / (time.perf_counter() - start):,.0f}",
                            refresh=False)
            running, count = 0.0, 0
    bar.close()
    student.eval()
    seconds = time.perf_counter() - start
    return {"step": steps, "loss": losses, "lr": lrs, "seconds": seconds, "tokens": tokens,
            "tokens_per_second": tokens / seconds if seconds else 0.0}
