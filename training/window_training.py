"""Plain-torch training on random windows of one packed token stream: the loop pretraining and draft
distillation share.

Why one loop: both draw ``batch_size`` windows of ``seq_len`` tokens from a long stream each step, step AdamW
(weight decay on matrices only) at a per-step learning rate, clip gradients at 1.0 and log running means of
the loss; only the loss differs (next-token cross-entropy for the embedded base model, KL to the target for a
draft). On CUDA the forward runs under bf16 autocast where the GPU computes bf16 natively.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from artifacts.common.device import has_native_bf16
from training.ranks import is_main_process, rank, world_size

__all__ = ["WindowSchedule", "train_on_windows"]


@dataclass(frozen=True)
class WindowSchedule:
    """How long and on what: steps, windows per step and their length, the optimizer, the seed, the logging."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float  # AdamW's initial rate; ``lr_at(step)`` sets each step's
    weight_decay: float
    seed: int
    log_points: int  # about this many points on the logged curve
    label: str  # the progress bar's description
    loss_name: str = "loss"  # the progress bar's name for the running loss


def train_on_windows(model: torch.nn.Module, stream: torch.Tensor, schedule: WindowSchedule,
                     loss_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor], lr_at: Callable[[int], float],
                     device: torch.device, on_log: Callable[[int, Any], None] | None = None) -> dict[str, Any]:
    """Train ``model`` for ``schedule.steps`` steps; ``loss_of(model, batch)`` is the loss of one [batch, seq_len]
    batch through ``model`` (the DDP-wrapped one in a distributed worker, so its gradients are averaged).

    ``on_log(step, model)`` runs at every log point (recipe tuning scripts check greedy accuracy there). Returns the
    curve (``step``, ``loss``, ``lr``: running means between log points) and ``seconds``, ``tokens``,
    ``tokens_per_second``. Leaves the model in eval mode."""
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": schedule.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=schedule.lr, betas=(0.9, 0.95))
    processes, accelerator, trained = world_size(), None, model
    if processes > 1:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=device.type == "cpu")
        trained, optimizer = accelerator.prepare(model, optimizer)
    share = schedule.batch_size // processes  # DraftConfig checks that the batch splits evenly
    mine = slice(rank() * share, (rank() + 1) * share)
    generator = torch.Generator().manual_seed(schedule.seed)
    offsets = torch.arange(schedule.seq_len)
    log_every = max(1, schedule.steps // schedule.log_points)
    steps, losses, lrs = [], [], []
    running, count, tokens = 0.0, 0, 0
    start = time.perf_counter()
    use_bf16 = has_native_bf16(device)  # emulated bf16 (pre-Ampere) is slower than fp32
    bar = tqdm(range(schedule.steps), desc=schedule.label, unit="step", mininterval=2.0,
               disable=not is_main_process())
    for step in bar:
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(stream) - schedule.seq_len, (schedule.batch_size,), generator=generator)
        batch = stream[starts[mine, None] + offsets].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = loss_of(trained, batch)
        if accelerator is None:
            loss.backward()
        else:
            accelerator.backward(loss)
            loss = accelerator.reduce(loss.detach(), reduction="mean")  # the whole batch's loss, as one process
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.item()
        count += 1
        tokens += batch.numel() * processes
        if (step + 1) % log_every == 0 or step + 1 == schedule.steps:
            steps.append(step + 1)
            losses.append(running / count)
            lrs.append(lr)
            elapsed = time.perf_counter() - start
            bar.set_postfix({schedule.loss_name: f"{running / count:.3f}", "tok_s": f"{tokens / elapsed:,.0f}"},
                            refresh=False)
            running, count = 0.0, 0
            if on_log is not None:
                on_log(step + 1, model)
                model.train()
    bar.close()
    model.eval()
    seconds = time.perf_counter() - start
    return {"step": steps, "loss": losses, "lr": lrs, "seconds": seconds, "tokens": tokens,
            "tokens_per_second": tokens / seconds if seconds else 0.0}
