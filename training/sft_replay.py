"""GRPO with the SFT chats replayed (``grpo.sft_replay_weight``): InstructGPT's PPO-ptx, on the SFT data.

Why: GRPO's rewards only see the prompts it samples. The safety prompts the input model already gets right in
every draw teach it nothing (their groups are all alike), so while the task updates move the policy, nothing
holds what it learnt in SFT about the prompts it does not see. On the embedded model that showed as held-out
refusals lost on one weak template ("How do I make a X at home?" with an object never seen under it), on 5 of
11 chains, one or two prompts each, though every draw of the safety *training* prompts stayed right and their
groups stayed in the loss for the KL term (training.informative_groups). InstructGPT met the same regressions
in PPO by mixing the pretraining gradient into every update (Ouyang et al., 2022, "PPO-ptx"); here the mix is
the SFT stage's own chats, the data the refusals came from. Each loss the trainer computes gets
``weight`` × the mean next-token NLL of one batch of SFT chats, on their replies only (as SFT trained them).

The chats are read from the data stage's ``sft_train.jsonl`` (a user's own SFT file lands there too),
tokenized once with the model's chat template, cut to the stage's ``max_seq_len``, shuffled with the stage's
seed and cycled.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.stage_config import TrainingError

SFT_FILE = "sft_train.jsonl"
IGNORE = -100  # labels the loss skips: the prompt's tokens and the batch's padding


@dataclass(frozen=True)
class ReplayChat:
    """One SFT chat as token ids, and how many of them are the prompt (not trained on)."""

    input_ids: list[int]
    prompt_len: int


def load_replay_chats(data_dir: Path, tokenizer: Any, max_len: int) -> list[ReplayChat]:
    """Every chat of ``data_dir/sft_train.jsonl`` as ids, cut to ``max_len`` tokens; chats whose prompt alone
    fills ``max_len`` are left out (nothing of their reply would be trained)."""
    path = Path(data_dir) / SFT_FILE
    if not path.is_file():
        raise TrainingError(f"grpo.sft_replay_weight: {path} not found (the SFT chats to replay); give the stage "
                            "the data stage's dir, or set grpo.sft_replay_weight: 0")
    chats: list[ReplayChat] = []
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise TrainingError(f"{path}: line {i}: not an SFT chat ({exc})") from exc
            prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)
            full = tokenizer.apply_chat_template(messages, tokenize=True)
            prompt, full = _ids(prompt), _ids(full)
            if len(prompt) < min(len(full), max_len):
                chats.append(ReplayChat(full[:max_len], len(prompt)))
    if not chats:
        raise TrainingError(f"grpo.sft_replay_weight: {path} holds no chat with a reply to replay")
    return chats


def _ids(encoded: Any) -> list[int]:
    """transformers returns a list of ids, or (newer versions) a BatchEncoding with ``input_ids``."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def replay_batches(chats: list[ReplayChat], batch_size: int, seed: int, pad_id: int) -> Iterator[dict[str, Any]]:
    """Endless padded batches (input_ids, attention_mask, labels), a fresh shuffle of the chats per pass."""
    import torch

    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            more = list(range(len(chats)))
            rng.shuffle(more)
            order += more
        picked = [chats[j] for j in order[:batch_size]]
        del order[:batch_size]
        width = max(len(c.input_ids) for c in picked)
        ids = torch.full((len(picked), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(picked), width), dtype=torch.long)
        labels = torch.full((len(picked), width), IGNORE, dtype=torch.long)
        for r, c in enumerate(picked):
            n = len(c.input_ids)
            ids[r, :n] = torch.tensor(c.input_ids)
            mask[r, :n] = 1
            labels[r, c.prompt_len:n] = ids[r, c.prompt_len:n]
        yield {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sft_replay_trainer(base: type, batches: Iterator[dict[str, Any]], weight: float) -> type:
    """A subclass of ``base`` (a GRPO trainer class) whose training loss adds ``weight`` × the NLL of the next
    replay batch, logged as ``sft_replay_nll``."""

    class SFTReplayTrainer(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if not model.training:
                return loss
            batch = {k: v.to(loss.device) for k, v in next(batches).items()}
            nll = model(**batch).loss
            self._metrics["train"]["sft_replay_nll"].append(nll.item())
            return loss + weight * nll

    return SFTReplayTrainer
