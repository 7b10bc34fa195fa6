"""Speculative decoding with a draft model: a smaller model of the same vocabulary guesses the next tokens.

Why: n-gram lookup (``serving.engine.speculative``) only guesses well where a reply repeats its context. A
draft model (a smaller sibling trained on the same data, or the target with layers cut off) guesses the
next tokens of any text, for a fraction of what a target step costs. The target checks the guesses as it
checks n-gram ones, keeping only those it would have chosen greedily, so the output is still the greedy
output token for token; only the number of tokens a step emits changes.

How: the draft is a second ``ModelRunner`` (same dtype, device and threads) with its own paged KV cache and
its own ``BlockManager`` (no prefix caching): the target's block table has no blocks yet for the guessed
positions, and the two models' KV differ anyway. Per request it keeps a shadow ``Sequence``: the tokens the
draft has seen, its block table in the draft cache, and how many of those tokens the draft has computed.
Each engine step, for every greedy decode at once:

1. sync: the target's tokens grew by the guesses it kept and its own token. The draft's cache is valid up to
   the first position where its tokens differ from the target's (the first rejected guess); its computed
   count goes back there, and later passes overwrite the KV written for rejected guesses;
2. catch-up: one batched pass over each sequence's tokens the draft has not computed (the whole prompt the
   first time, chunked to ``max_num_batched_tokens``; a few tokens afterwards); a sequence's last row gives
   its first guess (argmax);
3. up to ``k - 1`` batched one-token passes, each feeding the previous guess, give the others.

Each guess costs a draft pass, so a request is asked for as many guesses as it has lately been keeping
(``speculative.next_lookahead``), and never for more than are worth their passes (``speculative.GuessBudget``:
the draft's measured pass time against the target's step time, and the share of guesses kept). Where not
even one is worth it (a draft about as slow as a 4-bit target, on text it guesses badly), the request gets no
guesses, except in a measurement pass now and then (one guess after ``MEASURE_EVERY`` steps, then twice as
many steps after each such pass) that times the draft again and keeps the request's record current; a draft
whose pass costs more than a target step waits the longest between measurement passes, since no share of
guesses kept would pay for it.

The draft never fails the target: a sequence whose draft cannot get blocks, or whose pass raises (alone, once
the batch is retried piecewise), gets no guess this step; a device error alone ends the engine, as in the
target (``serving.engine.device_errors``). A request's draft blocks go back when it leaves the
engine (``release``), and any request missing from a step's greedy decodes (preempted, say) is released too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.device_errors import is_device_error
from serving.engine.errors import ModelLoadError
from serving.engine.model_runner import ModelRunner
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduled_seq import ScheduledSeq
from serving.engine.sequence import Sequence
from serving.engine.speculative import GuessBudget, expected_yield, next_lookahead

__all__ = ["MAX_MEASURE_EVERY", "MEASURE_EVERY", "DraftModelProposer", "draft_cache_blocks"]

log = logging.getLogger(__name__)

# a request with no guess worth a pass still gets one guess after this many steps (a measurement pass, which
# times the draft again); the wait doubles after each such pass (up to MAX_MEASURE_EVERY) and starts over once
# guesses pay again
MEASURE_EVERY = 8
MAX_MEASURE_EVERY = 128


def draft_cache_blocks(config: EngineConfig, target_blocks: int) -> int:
    """The draft cache's default size: what the target's cache holds, plus one span of guesses per sequence."""
    return target_blocks + config.max_num_seqs * -(-config.speculative_tokens // config.block_size)


@dataclass
class _Draft:
    seq: Sequence  # the draft's view of one request: tokens seen, draft block table, draft computed tokens
    synced: int = 0  # leading tokens known to equal the target's real tokens (guesses start after them)
    lookahead: int = 0  # guesses to ask for next step (next_lookahead); 0 = k
    kept: float = 0.0  # decayed guesses kept, and checked (GuessBudget): this request's acceptance
    checked: float = 0.0
    skipped: int = 0  # steps in a row without a guess because none was worth a pass
    measure_every: int = MEASURE_EVERY  # skipped steps before the next measurement pass (one guess)


class DraftModelProposer:
    """Greedy guesses from a draft model with its own KV cache; see the module docstring."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, vocab_size: int, tokenizer: Any,
                 num_blocks: int) -> None:
        path = Path(model_dir)
        _check_tokenizer(path, tokenizer)  # before the weights load: it is the cheap check
        try:
            self.runner = ModelRunner(path, dataclasses.replace(config, num_blocks=num_blocks))
        except ModelLoadError as exc:
            raise ModelLoadError(f"speculative model: {exc}") from exc
        if self.runner.vocab_size != vocab_size:
            raise ModelLoadError(f"speculative model {path}: its vocab_size is {self.runner.vocab_size}, the "
                                 f"target's {vocab_size}; a draft model must share the target's vocabulary")
        self.model_dir = path
        self.k = config.speculative_tokens
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_prefix_caching=False)
        self.max_len = min(self.runner.max_position, num_blocks * config.block_size)
        self.drafts: dict[str, _Draft] = {}
        self.budget = GuessBudget()
        self._step_cost: float | None = None  # this step's guessing, in seconds per decode-sized draft pass
        self._long_passes: list[float] = []  # this step's catch-ups over many tokens (a prompt, missed tokens)
        self._passes = 0  # this step's decode-sized passes
        self._warned = False
        self._said_costly = False

    # ----------------------------------------------------------------- the engine's side
    @property
    def draft_cost_ratio(self) -> float | None:
        return self.budget.cost_ratio

    def propose_many(self, seqs: list[Sequence], rooms: list[int]) -> dict[str, list[int]]:
        """Up to ``min(k, rooms[i])`` greedy guesses for each of ``seqs``, keyed by request id."""
        self.retain({seq.request_id for seq in seqs})
        return self.guess(seqs, rooms)

    def retain(self, request_ids: set[str]) -> None:
        """Release every request not in ``request_ids`` (preempted, or no longer a greedy decode): its blocks
        serve the others."""
        for rid in [rid for rid in self.drafts if rid not in request_ids]:
            self.release(rid)

    def guess(self, seqs: list[Sequence], rooms: list[int]) -> dict[str, list[int]]:
        """``propose_many`` for ``seqs``, keeping every other request's draft state."""
        self._step_cost, self._passes = None, 0
        self._long_passes.clear()
        try:
            started = time.perf_counter()
            guesses = self._propose(seqs, rooms)
            if self._passes:  # bookkeeping included; one-off catch-ups left out
                self._step_cost = (time.perf_counter() - started - sum(self._long_passes)) / self._passes
            return guesses
        except Exception as exc:  # noqa: BLE001 - a draft bug costs this step's guesses, never a request
            if is_device_error(exc):
                raise  # the device is the target's too: the engine ends (serving.engine.device_errors)
            self._warn(exc)
            for seq in seqs:
                self.release(seq.request_id)
            return {}

    def observe(self, request_id: str, drafted: int, kept: int) -> None:
        """Every guess kept: ask for more next step; any rejected: fewer (``next_lookahead``). The request's
        and the overall share of guesses kept feed ``GuessBudget``."""
        self.budget.record_guesses(drafted, kept)
        draft = self.drafts.get(request_id)
        if draft is not None:
            draft.lookahead = next_lookahead(draft.lookahead or self.k, drafted, kept, self.k)
            draft.kept, draft.checked = self.budget.updated((draft.kept, draft.checked), drafted, kept)

    def observe_step(self, target_seconds: float) -> None:
        """Weigh this step's guessing against the target's forward (``GuessBudget.cost_ratio``): per
        decode-sized draft pass, the draft's bookkeeping included and one-off catch-ups (a prompt, the tokens a
        request missed while it got no guesses) left out."""
        if self._step_cost is not None:
            self.budget.record_cost(self._step_cost, target_seconds)
            self._step_cost = None

    def value(self, seq: Sequence, room: int) -> float:
        """Target steps the draft's guesses for ``seq`` would save this step, less what its passes cost."""
        draft = self.drafts.get(seq.request_id)
        kept, checked, lookahead = (draft.kept, draft.checked, draft.lookahead) if draft else (0.0, 0.0, 0)
        a = self.budget.acceptance(kept, checked)
        n = min(lookahead or self.k, self.budget.worth(a, self.k), room)
        return expected_yield(a, n) - n * (self.budget.cost_ratio or 0.0)

    def _wanted(self, seq: Sequence, room: int) -> int:
        """Guesses to ask of the draft for ``seq`` this step: its lookahead, capped by what is worth a pass."""
        draft = self.drafts.get(seq.request_id)
        if draft is None:  # a new request: the draft's record over all requests decides
            draft = self.drafts[seq.request_id] = _Draft(Sequence(seq.request_id, [], SamplingParams()))
        worth = self.budget.worth(self.budget.acceptance(draft.kept, draft.checked), self.k)
        if worth == 0:
            self._say_costly()
            if (self.budget.cost_ratio or 0.0) >= 1.0:  # slower than a target step: no acceptance would pay
                draft.measure_every = MAX_MEASURE_EVERY
            draft.skipped += 1
            if draft.skipped < draft.measure_every:
                return 0
            draft.measure_every = min(2 * draft.measure_every, MAX_MEASURE_EVERY)
            draft.skipped = 0
            return min(2, room)  # the catch-up over the steps it missed, and one decode-sized pass to re-measure
        draft.measure_every = MEASURE_EVERY
        draft.skipped = 0
        return min(draft.lookahead or self.k, worth, room)

    def _say_costly(self) -> None:
        if not self._said_costly:
            log.info("draft model %s: a pass costs %.0f%% of a target step, so its guesses are asked for only "
                     "where they are kept often enough to pay", self.model_dir, 100 * (self.budget.cost_ratio or 0))
            self._said_costly = True

    def release(self, request_id: str) -> None:
        draft = self.drafts.pop(request_id, None)
        if draft is not None:
            self.block_manager.free_seq(draft.seq)

    # ----------------------------------------------------------------- one step of guesses
    def _propose(self, seqs: list[Sequence], rooms: list[int]) -> dict[str, list[int]]:
        work: list[tuple[Sequence, int]] = []  # (draft view, guesses wanted)
        for seq, room in zip(seqs, rooms):
            # guesses land at positions num_tokens..num_tokens+limit-1; the draft computes all but the last
            if self.max_len + 1 - seq.num_tokens < 1:
                self.release(seq.request_id)  # past what the draft can hold: no guesses from here on
                continue
            limit = min(self._wanted(seq, room), self.max_len + 1 - seq.num_tokens)
            if limit >= 1:
                work.append((self._sync(seq), limit))
        # 1. catch-up, fewest unseen tokens first so one-token catch-ups run as decodes
        work.sort(key=lambda w: w[0].num_tokens - w[0].num_computed_tokens)
        budget = self.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        wants: list[int] = []
        for d, limit in work:
            n = min(d.num_tokens - d.num_computed_tokens, budget)
            if n < 1:
                break
            if not self.block_manager.ensure_slots(d, n):
                self.release(d.request_id)  # the draft cache is full: no guess, and its blocks go to the others
                continue
            items.append(ScheduledSeq(d, n))
            wants.append(limit)
            budget -= n
        first = self._run(items, [item.seq.num_computed_tokens + item.num_tokens == item.seq.num_tokens
                                  for item in items])
        guesses: dict[str, list[int]] = {}
        active: list[tuple[Sequence, int]] = []
        for i, item in enumerate(items):
            if i not in first:
                continue  # that pass failed for this sequence
            d = item.seq
            d.num_computed_tokens += item.num_tokens
            token = first[i]
            if token is not None:  # caught up: its last row predicted the first guess
                guesses[d.request_id] = [token]
                d.token_ids.append(token)
                active.append((d, wants[i]))
        # 2. one token a pass for the sequences that want more guesses
        while True:
            active = [(d, limit) for d, limit in active
                      if len(guesses[d.request_id]) < limit and self.block_manager.ensure_slots(d, 1)]
            if not active:
                break
            step = [ScheduledSeq(d, 1) for d, _ in active]
            tokens = self._run(step, [True] * len(step))
            for i, (d, _) in enumerate(active):
                if i not in tokens:
                    continue
                d.num_computed_tokens += 1
                d.token_ids.append(tokens[i])
                guesses[d.request_id].append(tokens[i])
            active = [a for i, a in enumerate(active) if i in tokens]
        return guesses

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft's view of ``seq``, holding the target's real tokens, computed up to where they agree."""
        draft = self.drafts.get(seq.request_id)
        if draft is None:
            draft = self.drafts[seq.request_id] = _Draft(Sequence(seq.request_id, [], SamplingParams()))
        d, tokens = draft.seq, seq.token_ids
        end = min(d.num_computed_tokens, len(tokens) - 1)  # at least one token to compute, for its logits
        same = min(draft.synced, end)
        while same < end and d.token_ids[same] == tokens[same]:
            same += 1
        d.num_computed_tokens = same
        del d.token_ids[same:]
        d.token_ids.extend(tokens[same:])
        draft.synced = len(tokens)
        return d

    def _run(self, items: list[ScheduledSeq], sample: list[bool]) -> dict[int, int | None]:
        """One draft forward: item index -> its last row's argmax (None where it samples nothing).

        Items whose pass raised are missing: a batch that raises is retried one sequence at a time, so only
        a sequence that fails alone loses its guesses. KV writes are idempotent, so a retry is safe."""
        if not items:
            return {}
        # a catch-up over a prompt, or over what a request missed while it got no guesses, is a one-off
        long = max(item.num_tokens for item in items) > self.k + 1
        started = time.perf_counter()
        try:
            step = self.runner.execute(items, sample)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            if is_device_error(exc):
                raise
            if len(items) == 1:
                self._warn(exc)
                return {}
            done: dict[int, int | None] = {}
            for i, item in enumerate(items):
                if 0 in (alone := self._run([item], [sample[i]])):
                    done[i] = alone[0]
            return done
        done = dict.fromkeys(range(len(items)))
        if step.sample_rows:
            done.update(zip(step.sample_rows, step.sample_logits.argmax(-1).tolist()))
        if long:
            self._long_passes.append(time.perf_counter() - started)
        else:
            self._passes += 1
        return done

    def _warn(self, exc: Exception) -> None:
        """Say once, loudly, that the draft fails (then quietly): output is unaffected, speed is not."""
        level = logging.DEBUG if self._warned else logging.WARNING
        log.log(level, "draft model %s failed (%s: %s); the sequences concerned get no guesses this step",
                self.model_dir, type(exc).__name__, exc, exc_info=not self._warned)
        self._warned = True


def _check_tokenizer(path: Path, tokenizer: Any) -> None:
    """Refuse a draft whose tokenizer maps any token to another id than the target's (when both have one)."""
    if tokenizer is None or not (path / "config.json").is_file():
        return  # no tokenizer to compare with; a missing model is reported by the loader
    from transformers import AutoTokenizer

    try:
        draft = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        return  # a draft without a tokenizer: only its vocab_size can be compared
    ours, theirs = tokenizer.get_vocab(), draft.get_vocab()
    if ours != theirs:
        differ = sum(1 for tok, i in theirs.items() if ours.get(tok) != i) + len(ours.keys() - theirs.keys())
        raise ModelLoadError(f"speculative model {path}: its tokenizer differs from the target's ({differ} of "
                             f"{max(len(ours), len(theirs))} tokens missing or with other ids); a draft model "
                             "must share the target's vocabulary")
