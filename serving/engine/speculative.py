"""Speculative decoding by n-gram prompt lookup: guess the next tokens from the sequence's own context.

Why: at batch 1 a decode step reads every weight to produce one token, so it costs about what a step over a
few tokens costs. When a reply repeats its context (code edits, "repeat this list", quoting a document),
the continuation of the latest earlier occurrence of the last few tokens is a good guess for free. The
engine appends up to ``k`` guessed tokens, computes them in one step as a short chunk, and keeps the guesses
the model itself would have produced greedily, plus the model's own token after the last kept guess. Each
step therefore emits between 1 and ``k + 1`` tokens, and the output is the greedy output, token for token.

Only plain greedy requests speculate (temperature 0, no penalties, no logprobs, past ``min_tokens``): for
those the model's choice at every position is one argmax of the raw logits, so checking a guess is exact.
Everything else decodes one token a step as before, in the same batch.

Where guesses come from is a ``Proposer``: this module's n-gram lookup (free, good where the reply repeats
its context), or a small draft model of the same vocabulary (``serving.engine.draft_model``, good wherever
the draft agrees with the target). The engine only asks a proposer for guesses and tells it when a request
leaves; the checking above is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serving.engine.sequence import Sequence

__all__ = ["NgramProposer", "Proposer", "SpeculationStats", "accepted_prefix", "can_speculate", "next_lookahead"]


@dataclass
class SpeculationStats:
    """Cumulative counters for /metrics: acceptance rate = accepted / drafted."""

    steps: int = 0  # sequence-steps that verified at least one guessed token
    drafted: int = 0  # guessed tokens computed
    accepted: int = 0  # guessed tokens the model agreed with (emitted without a step of their own)


def can_speculate(seq: Sequence) -> bool:
    """A running decode whose next token is the argmax of the raw logits (so a guess can be checked exactly)."""
    p = seq.params
    return (p.greedy and not p.has_penalties and p.logprobs is None
            and seq.num_output_tokens >= p.min_tokens and seq.num_tokens - seq.num_computed_tokens == 1)


class Proposer(Protocol):
    """What the engine needs from a source of guesses.

    ``adaptive``: each guess costs the proposer work (a draft model's forward pass), so the engine asks each
    sequence for as many guesses as it has lately been keeping (``next_lookahead``), not always ``k``. A
    lookup that guesses for free keeps asking for ``k``."""

    adaptive: bool

    def propose_many(self, seqs: list[Sequence], rooms: list[int]) -> dict[str, list[int]]:
        """Guesses for ``seqs`` (greedy decodes, real tokens only), at most ``rooms[i]`` tokens for ``seqs[i]``,
        keyed by request id; a sequence may get none. Never raises for a sequence's sake."""
        ...

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, aborted, failed): drop whatever is kept for it."""
        ...


class NgramProposer:
    """Guess up to ``k`` tokens: what followed the latest earlier occurrence of the context's last n tokens.

    The longest suffix (``max_n`` down to ``min_n`` tokens) that occurred before wins: a longer match is a
    more specific context, so its continuation is more likely right. Searching only the last ``window``
    tokens bounds the cost of a step on long contexts.
    """

    adaptive = False  # a guess costs a list scan, so asking for fewer saves nothing

    def __init__(self, k: int, max_n: int = 4, min_n: int = 2, window: int = 2048) -> None:
        if k < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"speculation: need k >= 1 and 1 <= min_n <= max_n, got k={k}, n={min_n}..{max_n}")
        self.k, self.max_n, self.min_n, self.window = k, max_n, min_n, window

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """At most ``min(k, limit)`` guessed tokens following ``token_ids``; [] when the context never repeats."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        context = token_ids[-self.window:]
        size = len(context)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = context[size - n:]
            # the latest earlier occurrence: scan start positions from right to left, excluding the suffix
            for start in range(size - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + limit]
                    if follow:
                        return follow
        return []

    def propose_many(self, seqs: list[Sequence], rooms: list[int]) -> dict[str, list[int]]:
        guesses = {seq.request_id: self.propose(seq.token_ids, room) for seq, room in zip(seqs, rooms)}
        return {rid: g for rid, g in guesses.items() if g}

    def release(self, request_id: str) -> None:
        """Nothing to drop: the lookup keeps no state between steps."""


def accepted_prefix(drafts: list[int], greedy: list[int]) -> list[int]:
    """The tokens a verified step emits: the guesses the model agrees with, then the model's own next token.

    ``greedy[j]`` is the argmax after the last real token plus the first ``j`` guesses (len(drafts) + 1 rows).
    """
    kept = 0
    while kept < len(drafts) and drafts[kept] == greedy[kept]:
        kept += 1
    return drafts[:kept] + [greedy[kept]]


def next_lookahead(current: int, drafted: int, kept: int, k: int) -> int:
    """How many guesses to ask a sequence for next step, after it kept ``kept`` of ``drafted``.

    Every guess kept: two more next time (up to ``k``); any rejected: one fewer (down to 1). A draft model
    pays a forward pass per guess, so on text it cannot predict (a one-layer draft on a passage the target
    copies from its context, say) asking for ``k`` every step costs more passes than the kept guesses save;
    the same rule in Hugging Face's assisted generation ("heuristic" schedule) keeps the cost near what the
    guesses earn and climbs back within a few steps where they are kept again."""
    if drafted and kept == drafted:
        return min(k, current + 2)
    return max(1, current - 1)
