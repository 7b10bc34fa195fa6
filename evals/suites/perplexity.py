"""perplexity: token-weighted perplexity on held-out plain text.

Texts longer than the model's context are scored with a sliding window (stride half the context):
each token is predicted once, with up to a full window of preceding text. Token-weighted means
exp(total NLL / total predicted tokens), so long texts count for what they contain.
"""

from __future__ import annotations

import math

from evals.context import EvalContext
from evals.data import TEXT_FILE
from evals.logprobs import Item, completion_logprobs
from evals.results import EvalResult, SliceResult
from evals.suites.base import Suite
from evals.suites.common import slice_labels, stratum


def windows(ids: list[int], max_len: int) -> list[Item]:
    """Split one token sequence into (context, scored) pieces that each fit in ``max_len`` tokens."""
    if len(ids) < 2:
        return []
    if len(ids) <= max_len:
        return [(ids[:1], ids[1:])]
    stride = max(1, max_len // 2)
    items: list[Item] = [(ids[:1], ids[1:max_len])]
    done = max_len  # tokens [0, done) are scored (token 0 is never predicted)
    while done < len(ids):
        end = min(done + stride, len(ids))
        start = end - max_len
        items.append((ids[start:done], ids[done:end]))
        done = end
    return items


def run(ctx: EvalContext) -> list[EvalResult]:
    records = ctx.records(TEXT_FILE, {"text": str}, stratify=lambda r: stratum(r, "task", "source"))
    tok = ctx.lm.tokenizer
    items: list[Item] = []
    owner: list[int] = []
    for index, record in enumerate(records):
        pieces = windows(list(tok(record["text"])["input_ids"]), ctx.lm.max_context)
        items.extend(pieces)
        owner.extend([index] * len(pieces))
    logprobs = completion_logprobs(ctx.lm, items, ctx.config.batch_size, desc="perplexity")

    labels = slice_labels([stratum(r, "task", "source") for r in records])
    nll: dict[str, float] = {}
    count: dict[str, int] = {}
    for (_, scored), lp, index in zip(items, logprobs, owner, strict=True):
        for key in ("", *([labels[index]] if labels else [])):
            nll[key] = nll.get(key, 0.0) - lp
            count[key] = count.get(key, 0) + len(scored)
    total = count.get("", 0)
    value = math.exp(nll[""] / total) if total else float("nan")
    slices = {k: SliceResult(value=math.exp(nll[k] / count[k]), n=count[k]) for k in count if k}
    # n counts predicted tokens: that is what the value is weighted by
    return [EvalResult(suite="perplexity", metric="perplexity", value=value, n=total, slices=slices)]


SUITE = Suite("perplexity", (TEXT_FILE,), run, "token-weighted perplexity on held-out text (lower is better)")
