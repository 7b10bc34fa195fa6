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


# Upper bound on logits held at once (batch x length x vocab): 2^29 fp32 values = 2 GiB. A 150k-vocab
# model then scores ~3.5k tokens per forward pass; the micro model is limited by batch_size only.
LOGITS_BUDGET = 1 << 29


def _plan_batches(order: list[int], lengths: list[int], batch_size: int, vocab: int) -> list[list[int]]:
    """Consecutive groups of ``order`` (sorted longest first) within batch_size and the logits budget."""
    batches: list[list[int]] = []
    for i in order:
        current = batches[-1] if batches else None
        if current and len(current) < batch_size and \
                (len(current) + 1) * lengths[current[0]] * vocab <= LOGITS_BUDGET:
            current.append(i)
        else:
            batches.append([i])
    return batches


def completion_logprobs(lm: LoadedModel, items: list[Item], batch_size: int,
                        desc: str = "score") -> list[float]:
    """For each (prompt, completion): sum over completion tokens of log p(token | everything before)."""
    for prompt, completion in items:
        if not prompt or not completion:
            raise ValueError("completion_logprobs: prompt and completion must both be non-empty")
    lengths = [len(p) + len(c) for p, c in items]
    order = sorted(range(len(items)), key=lambda i: lengths[i], reverse=True)
    vocab = int(getattr(lm.model.config, "vocab_size", 0) or len(lm.tokenizer))
    out: list[float] = [0.0] * len(items)
    for batch in tqdm(_plan_batches(order, lengths, batch_size, vocab), desc=desc, unit="batch"):
        width = lengths[batch[0]]
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
