"""Iteration-level scheduler: each step it plans what to compute, then applies what was computed.

``schedule()`` picks the sequences (and token counts) to compute, under one token budget
(``max_num_batched_tokens``), in this order:
1. running sequences that decode (one token each, plus any guesses), so a long prompt never stalls them;
2. running sequences still prefilling (a chunk each when chunked prefill is on);
3. waiting sequences, best priority then oldest first, while the budget, ``max_num_seqs`` and the
   free blocks allow (their cached prefix blocks are attached first and cost no compute).
When a running sequence needs a block and none is free, the newest running sequence is preempted by
recompute: its blocks are freed and it goes back to the head of the queue, keeping its tokens. A request on a LoRA
adapter is admitted only while its adapter can be resident (``lora.LoraManager``): it holds the adapter's slot while
it runs, and the plan puts each adapter's rows side by side.
The result is a plain plan (``SchedulerOutput``) that the executor runs.

``launched()`` moves each planned sequence on as soon as its step is launched, before anything is known of the
result: its computed count covers the step's tokens, and a sequence that samples gets a ``PLACEHOLDER`` id where
the token will go. So the next plan can be made while the step runs (async scheduling: the sequence then decodes
the placeholder, whose value the runner reads on the device). A sequence whose pending token must end it by length
is not planned again.

``update_from_output()`` applies the step's ``ModelOutput``, as in vLLM v1: the sampled token written over its
placeholder, guesses kept or rolled back (``spec_commit``), stop rules checked (``stop_rules``), full blocks
registered for prefix caching, and finished requests taken out with their blocks freed in that same step. A
sequence that finished in the meantime (aborted, or ended by the step before) is skipped: what a later step
computed for it is dropped. The scheduler owns the block manager; nothing else allocates or frees KV blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.outputs import EngineStats, LogprobRecord, ModelOutput, RequestOutput, request_output
from serving.engine.scheduled_seq import ScheduledSeq
from serving.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from serving.engine.spec_commit import Speculator, drop_drafts, fit_drafts
from serving.engine.speculative import Proposer
from serving.engine.stop_rules import stopped_after

if TYPE_CHECKING:
    from serving.engine.lora import LoraManager

log = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """One step's plan: the sequences to compute and how many tokens each (vLLM v1's ``{request_id:
    num_tokens}``, kept as sequences since the runner reads their tokens and block tables)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    drafted: list[Sequence] = field(default_factory=list)  # sequences that got guesses this step

    def drop_drafts(self) -> None:
        """Take off whatever guesses are left: a guess never outlives its step."""
        for seq in self.drafted:
            drop_drafts(seq)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """The engine's sequences from admission to finish: their queues, KV blocks, guesses and counters."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int,
                 proposer: Proposer | None = None, lora: LoraManager | None = None) -> None:
        self.config = config
        self.lora = lora  # adapters: a running request holds its own resident (lora.py)
        self.max_model_len = max_model_len
        self.bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.speculator = Speculator(proposer, max_model_len)
        self.requests: dict[str, Sequence] = {}  # every request added and not finished, by id
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.finished_ids: list[str] = []  # requests finished since the engine last took this list
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished_total = 0
        self.requests_failed_total = 0

    # ----------------------------------------------------------------- queue
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq
        self.prompt_tokens_total += seq.num_prompt_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of its queue and free its blocks now."""
        if seq in self.running:
            self.running.remove(seq)
            self._release_adapter(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_adapter(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)  # keeps its arrival time, so it is picked again first

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora is not None and seq.lora_slot >= 0:
            self.lora.release(seq.lora)
            seq.lora_slot = -1

    # ----------------------------------------------------------------- plan
    def schedule(self) -> SchedulerOutput:
        """This step's plan. Greedy decodes get their guesses first, so the budget counts them; the plan
        then keeps only the guesses it computes."""
        drafted = self.speculator.propose(self.running)
        try:
            out = self._plan()
        except BaseException:
            for seq in drafted:
                drop_drafts(seq)
            raise
        if drafted:
            fit_drafts(drafted, out.scheduled)
            out.drafted = drafted
        if self.lora is not None and len(out.scheduled) > 1:
            # each adapter's rows side by side (one slice per adapter in the LoRA step, no gather); one-token
            # items stay first, where the runner takes its decodes from
            out.scheduled.sort(key=lambda item: (item.num_tokens != 1, item.seq.lora_slot))
        return out

    def _plan(self) -> SchedulerOutput:
        """The budget loop of the module docstring: running sequences first, then admissions."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        scheduled_ids: set[int] = set()

        decodes = [s for s in self.running if not s.is_prefill]
        prefills = [s for s in self.running if s.is_prefill]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if seq.num_pending and self._ends_by_length(seq):
                continue  # its token in flight is its last: it finishes when that step's result lands
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                if not chunked:
                    continue
                n = budget
            while not self.bm.ensure_slots(seq, n):
                victim = next((s for s in reversed(self.running) if id(s) not in scheduled_ids), None)
                if victim is None:
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING or seq.num_computed_tokens + n > \
                    len(seq.block_table) * self.bm.block_size:
                continue
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n

        if out.preempted:
            return out  # blocks are short: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            admissible = self.waiting if self.lora is None else \
                [s for s in self.waiting if s.lora is None or self.lora.can_hold(s.lora)]
            if not admissible:
                break  # every waiting request's adapter needs a slot that running requests hold
            seq = min(admissible, key=lambda s: (s.priority, s.arrival_time))
            n = seq.num_tokens  # upper bound: a cached prefix only lowers it
            if n > budget:
                if not chunked:
                    break
                n = budget
            if not self.bm.can_admit(seq, n):
                break
            self.waiting.remove(seq)
            self.bm.admit(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            n = min(n, budget)  # only reachable with chunking (can_admit checked the unchunked case)
            if not self.bm.ensure_slots(seq, n):  # cannot happen after can_admit; be safe anyway
                self.bm.free_seq(seq)
                self.waiting.append(seq)
                break
            seq.status = SequenceStatus.RUNNING
            if seq.lora is not None:
                seq.lora_slot = self.lora.hold(seq.lora)
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n
        return out

    def _ends_by_length(self, seq: Sequence) -> bool:
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    # ----------------------------------------------------------------- launch
    def launched(self, plan: SchedulerOutput, sample_flags: list[bool]) -> None:
        """The plan's step is under way: move its sequences on (see the module docstring). Sequences checking
        guesses are moved by their commit instead (speculation runs one step at a time)."""
        for item, samples in zip(plan.scheduled, sample_flags):
            seq = item.seq
            if seq.draft_token_ids:
                continue
            item.start = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_tokens
            if samples:
                item.sample_index = len(seq.token_ids)
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1

    # ----------------------------------------------------------------- apply
    def update_from_output(self, plan: SchedulerOutput, out: ModelOutput) -> list[RequestOutput]:
        """Apply a computed step to each planned sequence; return the outputs of those it touched.

        A failure here fails that sequence alone, as does an error the executor carried over (a sequence that
        failed even when run alone)."""
        if plan.drafted and out.forward_seconds is not None:
            self.speculator.observe_step(out.forward_seconds)
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        flags, records, sampled, verified, errors = (out.sample_flags, out.prompt_records, out.sampled,
                                                     out.verified, out.errors)
        for i, item in enumerate(plan.scheduled):
            if item.seq.status == SequenceStatus.FINISHED:
                continue  # aborted, or ended by the step before, while this one ran: its work here is dropped
            if errors and i in errors:
                outputs.append(self.fail(item.seq, errors[i]))
                continue
            try:
                if i in verified:
                    res = self._commit_checked(item, verified[i], now)
                else:
                    res = self._commit_one(item, flags[i], records.get(i), sampled.get(i), now)
            except Exception as exc:  # noqa: BLE001 - a bug for this request only
                res = self.fail(item.seq, exc)
            if res is not None:
                outputs.append(res)
        return outputs

    def _commit_one(self, item: ScheduledSeq, sample_flag: bool,
                    prompt_records: tuple[int, list[LogprobRecord]] | None,
                    sampled: tuple[int, LogprobRecord | None] | None, now: float) -> RequestOutput | None:
        """A step without guesses (launched: ``launched`` counted its tokens computed): its full blocks registered,
        and its sampled token written where its placeholder stands, the stop rules seeing the sequence as it was
        at this step (placeholders of a later step in flight are set aside meanwhile)."""
        seq = item.seq
        end = item.start + item.num_tokens
        self.bm.commit_full_blocks(seq, end)
        if prompt_records is not None:
            first, recs = prompt_records
            for r, rec in enumerate(recs):
                if first + r == len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append(rec)
        if not sample_flag:
            # prefill-only requests (max_tokens == 0) finish once their prompt is computed
            if seq.params.max_tokens == 0 and end == seq.num_tokens:
                seq.finish_reason = "length"
                return self.finish(seq)
            return None
        tok, lp = sampled
        later = seq.token_ids[item.sample_index + 1:]  # placeholders of a step launched after this one
        del seq.token_ids[item.sample_index:]
        seq.num_pending = 0
        seq.token_ids.append(tok)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if lp is not None:
            seq.logprobs.append(lp)
        stopped = stopped_after(seq, tok, self.max_model_len)
        lps = [lp] if lp is not None else None
        if stopped:
            return self.finish(seq, [tok], lps)
        out = request_output(seq, [tok], lps, finished=False)
        seq.token_ids.extend(later)
        seq.num_pending = len(later)
        return out

    def _commit_checked(self, item: ScheduledSeq, greedy: list[int], now: float) -> RequestOutput:
        """A step that checked guesses: the kept ones and the model's own token (``Speculator.commit``)."""
        seq = item.seq
        new_ids: list[int] = []
        try:
            stopped = self.speculator.commit(seq, greedy, now, new_ids)
        finally:
            self.generation_tokens_total += len(new_ids)
        self.bm.commit_full_blocks(seq)
        if stopped:
            return self.finish(seq, new_ids)
        return request_output(seq, new_ids, None, finished=False)

    # ----------------------------------------------------------------- finish
    def finish(self, seq: Sequence, new_ids: list[int] | None = None,
               new_lp: list[LogprobRecord] | None = None) -> RequestOutput:
        """End a request now (``finish_reason`` set): out of its queue, its blocks and a draft model's for it
        freed, its id in ``finished_ids``; returns its last output (without tokens still in flight)."""
        if seq.num_pending:
            del seq.token_ids[-seq.num_pending:]
            seq.num_pending = 0
        self.remove(seq)
        self.speculator.release(seq.request_id)
        self.requests_finished_total += 1
        out = request_output(seq, new_ids or [], new_lp, finished=True)
        self.requests.pop(seq.request_id, None)
        self.finished_ids.append(seq.request_id)
        return out

    def fail(self, seq: Sequence, exc: BaseException) -> RequestOutput:
        """Finish one request because serving it raised: one request's failure never fails the engine."""
        log.error("request %s failed inside the engine: %s: %s", seq.request_id, type(exc).__name__, exc,
                  exc_info=exc)
        self.requests_failed_total += 1
        seq.finish_reason = "error"
        out = self.finish(seq)
        out.error = f"{type(exc).__name__}: {exc}"
        return out

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request the client gave up on; None when it is not here (finished already, say)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        return self.finish(seq)

    def make_stats(self, num_queued: int, num_steps: int, num_steps_overlapped: int = 0) -> EngineStats:
        """A snapshot for /metrics; ``num_queued`` requests wait in the engine's inbox, not here yet."""
        bm, spec = self.bm, self.speculator
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting) + num_queued,
                           kv_usage=bm.usage(), prefix_cache_hits=bm.prefix_cache_hits,
                           prefix_cache_queries=bm.prefix_cache_queries, num_preemptions=self.num_preemptions,
                           num_blocks=bm.num_blocks, block_size=bm.block_size, num_free_blocks=bm.num_free_blocks,
                           prompt_tokens_total=self.prompt_tokens_total,
                           generation_tokens_total=self.generation_tokens_total,
                           requests_finished_total=self.requests_finished_total, num_steps=num_steps,
                           num_steps_overlapped=num_steps_overlapped,
                           spec_draft_tokens_total=spec.stats.drafted,
                           spec_accepted_tokens_total=spec.stats.accepted,
                           spec_draft_cost_ratio=spec.draft_cost_ratio, **self._lora_stats())

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        running = self.lora.running
        waiting = sorted({s.lora.name for s in self.waiting if s.lora is not None} - set(running))
        return {"lora_running": tuple(running), "lora_waiting": tuple(waiting),
                "max_loras": self.lora.slots.max_loras}
