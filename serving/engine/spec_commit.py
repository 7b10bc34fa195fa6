"""Guessed tokens through one engine step: appended before the plan, trimmed to what it computes, checked after.

A guess lives for one step only. The scheduler asks the proposer (``serving.engine.speculative``) for guesses
before it plans, so a sequence's guesses are computed in the same forward as its last real token; the plan
may then leave some of them out (the token budget, the free blocks). After the forward, the guesses the model
agrees with are emitted with the model's own next token, and the rest are rolled back: they leave
``token_ids`` and ``num_computed_tokens`` stops before them, so the KV slots written for them count as free
and the next pass overwrites them. The output is the greedy output token for token.
"""

from __future__ import annotations

from serving.engine.scheduled_seq import ScheduledSeq
from serving.engine.sequence import Sequence
from serving.engine.speculative import Proposer, SpeculationStats, accepted_prefix, can_speculate
from serving.engine.stop_rules import stopped_after

__all__ = ["Speculator", "drop_drafts", "fit_drafts"]


class Speculator:
    """The scheduler's side of speculative decoding: asks for guesses, commits the checked ones, counts."""

    def __init__(self, proposer: Proposer | None, max_model_len: int) -> None:
        self.proposer = proposer  # None: speculation is off, and every method is a cheap no-op
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()

    def propose(self, running: list[Sequence]) -> list[Sequence]:
        """Append guesses to the greedy decodes the proposer has some for; returns those sequences.

        Called every step, guesses or not: a draft model frees the state of requests that left the decodes.
        A guess never takes a request past ``max_tokens`` or the context: the model's own token follows it.
        """
        if self.proposer is None:
            return []
        seqs, rooms = [], []
        for seq in running:
            if not can_speculate(seq):
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if room > 0:
                seqs.append(seq)
                rooms.append(room)
        guesses = self.proposer.propose_many(seqs, rooms)
        drafted = []
        for seq in seqs:
            drafts = guesses.get(seq.request_id)
            if drafts:
                seq.draft_token_ids = drafts
                seq.token_ids.extend(drafts)
                drafted.append(seq)
        return drafted

    def commit(self, seq: Sequence, greedy: list[int], now: float, new_ids: list[int]) -> bool:
        """Emit the guesses the model agreed with and its own next token, through the stop rules; roll back
        the rest. ``greedy`` holds the model's argmax after the last real token and after each guess.

        The emitted tokens are appended to ``new_ids`` as they go, so a caller counts them even when a stop
        rule raises midway. Returns whether a stop rule ended the sequence.
        """
        drafts = seq.draft_token_ids
        emitted = accepted_prefix(drafts, greedy)
        drop_drafts(seq)
        if self.proposer is not None:
            self.proposer.observe(seq.request_id, len(drafts), len(emitted) - 1)
        self.stats.steps += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += len(emitted) - 1
        # the KV of the last real token and of every kept guess is in the cache now
        computed = seq.num_computed_tokens + len(emitted)
        stopped = False
        for tok in emitted:
            seq.token_ids.append(tok)
            new_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            stopped = stopped_after(seq, tok, self.max_model_len)
            if stopped:
                break
        # the rollback: slots past the emitted tokens (rejected guesses, or kept ones after a stop) are free
        seq.num_computed_tokens = min(computed, seq.num_tokens)
        return stopped

    def observe_step(self, forward_seconds: float) -> None:
        """The target's forward for a step with guesses took ``forward_seconds``: what a draft pass weighs."""
        if self.proposer is not None:
            self.proposer.observe_step(forward_seconds)

    def release(self, request_id: str) -> None:
        """The request left: a draft model's blocks for it go back now."""
        if self.proposer is not None:
            self.proposer.release(request_id)

    @property
    def draft_cost_ratio(self) -> float:
        """A draft pass's cost over a target step, as measured (0.0: no draft model, or not measured yet)."""
        return (self.proposer and self.proposer.draft_cost_ratio) or 0.0


def fit_drafts(drafted: list[Sequence], scheduled: list[ScheduledSeq]) -> None:
    """Keep the guesses the step computes: none for a sequence the plan left out, fewer for one it cut short
    (a plan computes a sequence's last real token, then as many of its guesses as fit)."""
    computed = {id(item.seq): item.num_tokens for item in scheduled}
    for seq in drafted:
        keep = computed.get(id(seq), 1) - 1
        if keep < len(seq.draft_token_ids):
            del seq.token_ids[len(seq.token_ids) - len(seq.draft_token_ids) + keep:]
            seq.draft_token_ids = seq.draft_token_ids[:keep]


def drop_drafts(seq: Sequence) -> None:
    """Take a sequence's pending guesses off the end of its tokens."""
    if seq.draft_token_ids:
        del seq.token_ids[len(seq.token_ids) - len(seq.draft_token_ids):]
        seq.draft_token_ids = []
