"""Summed log-probabilities of completions given prompts: the one primitive behind perplexity and
preference accuracy.

Rows are right-padded (positions stay 0..n-1 for every row) and sorted by length so a batch wastes
little compute on padding. Only the completion positions go through log-softmax, so a model with a
150k vocabulary does not materialise a (batch, length, vocab) copy of its logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from evals.model import LoadedModel

Item = tuple[list[int], list[int]]  # (prompt ids, completion ids); prompt has at least one token


def completion_logprobs(lm: LoadedModel, items: list[Item], batch_size: int,
                        desc: str = "score") -> list[float]:
    """For each (prompt, completion): sum over completion tokens of log p(token | everything before)."""
    for prompt, completion in items:
        if not prompt or not completion:
            raise ValueError("completion_logprobs: prompt and completion must both be non-empty")
    lengths = [len(p) + len(c) for p, c in items]
    order = sorted(range(len(items)), key=lambda i: lengths[i], reverse=True)
    out: list[float] = [0.0] * len(items)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch"):
        batch = order[start:start + batch_size]
        width = max(lengths[i] for i in batch)
        ids = torch.full((len(batch), width), lm.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            seq = items[i][0] + items[i][1]
            ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = 1
        with torch.inference_mode():
            logits = lm.model(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device)).logits
            for row, i in enumerate(batch):
                p_len, c_len = len(items[i][0]), len(items[i][1])
                # logits at position t predict token t+1
                row_logits = logits[row, p_len - 1:p_len - 1 + c_len].float()
                targets = ids[row, p_len:p_len + c_len].to(row_logits.device)
                nll = F.cross_entropy(row_logits, targets, reduction="sum")
                out[i] = -float(nll)
    return out
