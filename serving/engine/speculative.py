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
its context), a small draft model of the same vocabulary (``serving.engine.draft_model``, good wherever
the draft agrees with the target), or both (``LookupThenDraft``: the lookup where the context repeats, the
draft elsewhere). The engine only asks a proposer for guesses, tells it how many of them the model kept,
and tells it when a request leaves; the checking above is the same for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from serving.engine.sequence import Sequence

__all__ = ["GuessBudget", "LookupThenDraft", "NgramProposer", "Proposer", "SpeculationStats", "accepted_prefix",
           "can_speculate", "checked_guesses", "expected_yield", "next_lookahead"]


@dataclass
class SpeculationStats:
    """Cumulative counters for /metrics: acceptance rate = accepted / drafted."""

    steps: int = 0  # sequence-steps that verified at least one guessed token
    drafted: int = 0  # guessed tokens computed
    accepted: int = 0  # guessed tokens the model agreed with (emitted without a step of their own)


def can_speculate(seq: Sequence) -> bool:
    """A running decode whose next token is the argmax of the raw logits (so a guess can be checked exactly).

    Not a constrained reply: its next token is the argmax of the *masked* logits, and checking guesses against
    the grammar would cost a mask per guess on the host, where one row's mask costs about what a guess saves
    on a CPU replica (benchmarks/RESULTS.md, "Grammar libraries")."""
    p = seq.params
    return (p.greedy and not p.has_penalties and p.logprobs is None and seq.grammar is None
            and seq.num_output_tokens >= p.min_tokens and seq.num_tokens - seq.num_computed_tokens == 1)


class Proposer(Protocol):
    """What the engine needs from a source of guesses."""

    @property
    def draft_cost_ratio(self) -> Optional[float]:
        """What a draft model's pass costs over a target step, as measured so far (None: no draft, or not yet)."""
        ...

    def propose_many(self, seqs: list[Sequence], rooms: list[int]) -> dict[str, list[int]]:
        """Guesses for ``seqs`` (greedy decodes, real tokens only), at most ``rooms[i]`` tokens for ``seqs[i]``,
        keyed by request id; a sequence may get none. Never raises for a sequence's sake. A request that had
        guesses before and is not among ``seqs`` (preempted, say) may be forgotten."""
        ...

    def observe(self, request_id: str, drafted: int, kept: int) -> None:
        """The model checked ``drafted`` guesses for the request and kept the first ``kept`` of them. A
        proposer whose guesses cost work (a draft model's passes) asks for fewer where few are kept."""
        ...

    def observe_step(self, target_seconds: float) -> None:
        """The target's forward pass of the step that checked this step's guesses took ``target_seconds``
        (what a proposer's work is weighed against)."""
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

    draft_cost_ratio = None  # no draft model

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

    def observe(self, request_id: str, drafted: int, kept: int) -> None:
        """Nothing to adapt: a guess costs a list scan, so asking for fewer would save nothing."""

    def observe_step(self, target_seconds: float) -> None:
        """Nothing to weigh: the lookup's cost is not worth measuring."""

    def release(self, request_id: str) -> None:
        """Nothing to drop: the lookup keeps no state between steps."""


class DraftSource(Proposer, Protocol):
    """A draft model's side of ``LookupThenDraft``: guesses for some of the step's sequences while keeping the
    state (KV cache, lookahead) of every request still decoding (``serving.engine.draft_model``)."""

    def retain(self, request_ids: set[str]) -> None:
        """Forget every request not in ``request_ids``."""
        ...

    def guess(self, seqs: list[Sequence], rooms: list[int]) -> dict[str, list[int]]:
        """``propose_many`` for ``seqs`` only, forgetting nobody."""
        ...

    def value(self, seq: Sequence, room: int) -> float:
        """What asking the draft for ``seq`` would earn this step: target steps saved, minus its passes' cost."""
        ...


class LookupThenDraft:
    """The n-gram lookup's guesses where the context repeats and they beat the draft's, the draft's elsewhere.

    Why: a small draft guesses fresh text well but cannot copy a passage from its context (on prompts that
    repeat their context a one-layer draft keeps about half its guesses; the lookup kept three in four on the
    bench model's). The
    lookup costs nothing, but its guesses are not always the better ones: on fresh text a two-token match is
    often chance, and a wrong guess displaces the draft's right one. So where the lookup finds a match, its
    guesses are taken when their expected yield (the sum of ``a ** j`` over the guesses, ``a`` the share of
    the lookup's guesses this request has kept, drawn toward the overall share) is at least what the draft
    would earn (``DraftSource.value``: its expected yield less its passes' cost). The draft's lookahead learns
    only from its own guesses, and the draft keeps every request's KV cache while the lookup guesses for it,
    catching up on the tokens it missed in one pass when it is asked again.
    """

    def __init__(self, lookup: NgramProposer, draft: DraftSource) -> None:
        self.lookup, self.draft = lookup, draft
        self.lookup_record = GuessBudget()  # the lookup's share of guesses kept (it costs no draft pass)
        self._records: dict[str, tuple[float, float]] = {}  # request -> the lookup's (kept, checked), decayed
        self._source: dict[str, str] = {}  # request -> who guessed for it this step: "lookup" or "draft"

    @property
    def draft_cost_ratio(self) -> Optional[float]:
        return self.draft.draft_cost_ratio

    def propose_many(self, seqs: list[Sequence], rooms: list[int]) -> dict[str, list[int]]:
        live = {seq.request_id for seq in seqs}
        self.draft.retain(live)
        for rid in [rid for rid in self._records if rid not in live]:
            del self._records[rid]
        guesses: dict[str, list[int]] = {}
        rest: list[Sequence] = []
        rest_rooms: list[int] = []
        for seq, room in zip(seqs, rooms):
            found = self.lookup.propose(seq.token_ids, room)
            if found:
                a = self.lookup_record.acceptance(*self._records.get(seq.request_id, (0.0, 0.0)))
                if expected_yield(a, len(found)) >= self.draft.value(seq, room):
                    guesses[seq.request_id] = found
                    continue
            rest.append(seq)
            rest_rooms.append(room)
        from_draft = self.draft.guess(rest, rest_rooms)
        self._source = dict.fromkeys(guesses, "lookup") | dict.fromkeys(from_draft, "draft")
        return guesses | from_draft

    def observe(self, request_id: str, drafted: int, kept: int) -> None:
        source = self._source.get(request_id)
        if source == "draft":
            self.draft.observe(request_id, drafted, kept)
        elif source == "lookup":
            self.lookup_record.record_guesses(drafted, kept)
            self._records[request_id] = self.lookup_record.updated(self._records.get(request_id, (0.0, 0.0)),
                                                                   drafted, kept)

    def observe_step(self, target_seconds: float) -> None:
        self.draft.observe_step(target_seconds)

    def release(self, request_id: str) -> None:
        self._records.pop(request_id, None)
        self.draft.release(request_id)


def expected_yield(acceptance: float, guesses: int) -> float:
    """Tokens ``guesses`` guesses are expected to add to a step: the j-th is kept with chance ``a ** j``."""
    return sum(acceptance ** j for j in range(1, guesses + 1))


def accepted_prefix(drafts: list[int], greedy: list[int]) -> list[int]:
    """The tokens a verified step emits: the guesses the model agrees with, then the model's own next token.

    ``greedy[j]`` is the argmax after the last real token plus the first ``j`` guesses (len(drafts) + 1 rows).
    """
    kept = 0
    while kept < len(drafts) and drafts[kept] == greedy[kept]:
        kept += 1
    return drafts[:kept] + [greedy[kept]]


@dataclass
class GuessBudget:
    """How many draft guesses are worth their passes, from what a pass costs and how often guesses are kept.

    Why: a draft pass is not free, and what it costs relative to a target step depends on the pair and the
    hardware. With its bookkeeping, a one-layer fp32 draft costs about a third of a step of the default
    pipeline's fp32 4-layer model, where four guesses a step pay, but more than a step of its 4-bit snapshot,
    where none does (figures in ``benchmarks/NOTEBOOK.md``). The j-th guess of a step is kept with probability about
    ``a ** j`` (``a``: the share of guesses kept, counting each guess checked up to the first rejection) and
    costs one draft pass, ``c`` of a target step; it saves a target step when kept, so it is worth asking
    for while ``a ** j >= c``. ``c`` is measured as the engine runs (decayed average of the ratio of a step's
    guessing time per draft pass, bookkeeping included, to the target's forward time in the same step), ``a``
    per request with the draft's record over all requests as its prior. Until a cost is measured every guess
    is worth it.
    """

    decay: float = 0.8  # weight of the past in each decayed average
    prior_weight: float = 2.0  # a request's own record counts as much as the overall one after this many checks
    cost_ratio: Optional[float] = None  # a draft pass's seconds over a target forward's
    warmup: int = 1  # measurements to ignore at first
    kept: float = 0.0  # decayed guesses kept, all requests
    checked: float = 0.0  # decayed guesses checked up to the first rejection, all requests

    def record_cost(self, pass_seconds: float, target_seconds: float) -> None:
        if pass_seconds <= 0 or target_seconds <= 0:
            return
        if self.warmup > 0:  # the first steps of a process build kernels and buffers: not what a pass costs
            self.warmup -= 1
            return
        ratio = pass_seconds / target_seconds
        self.cost_ratio = ratio if self.cost_ratio is None else self.decay * self.cost_ratio + (1 - self.decay) * ratio

    def record_guesses(self, drafted: int, kept: int) -> None:
        self.kept, self.checked = self.updated((self.kept, self.checked), drafted, kept)

    def updated(self, record: tuple[float, float], drafted: int, kept: int) -> tuple[float, float]:
        """A (kept, checked) record, decayed, after a check that kept ``kept`` of ``drafted`` guesses."""
        return (self.decay * record[0] + kept, self.decay * record[1] + checked_guesses(drafted, kept))

    def acceptance(self, kept: float = 0.0, checked: float = 0.0) -> float:
        """A request's share of guesses kept (its own ``kept`` of ``checked``), drawn toward the overall one."""
        overall = self.kept / self.checked if self.checked else 1.0
        return (kept + self.prior_weight * overall) / (checked + self.prior_weight)

    def worth(self, acceptance: float, k: int) -> int:
        """The number of guesses (0..k) whose chance of being kept is at least what a draft pass costs."""
        if self.cost_ratio is None:
            return k
        n, chance = 0, acceptance
        while n < k and chance >= self.cost_ratio:
            n += 1
            chance *= acceptance
        return n


def checked_guesses(drafted: int, kept: int) -> int:
    """Guesses the check looked at: every kept one, and the first rejected one if any (the rest are moot)."""
    return kept + (1 if kept < drafted else 0)


def next_lookahead(current: int, drafted: int, kept: int, k: int) -> int:
    """How many guesses to ask a draft model for next step, after the model kept ``kept`` of ``drafted``.

    Every guess kept: two more next time (up to ``k``); any rejected: one fewer (down to 1). A draft model
    pays a forward pass per guess, so on text it cannot predict (a one-layer draft on a passage the target
    copies from its context, say) asking for ``k`` every step costs more passes than the kept guesses save;
    the same rule in Hugging Face's assisted generation ("heuristic" schedule) keeps the cost near what the
    guesses earn and climbs back within a few steps where they are kept again."""
    if drafted and kept == drafted:
        return min(k, current + 2)
    return max(1, current - 1)
