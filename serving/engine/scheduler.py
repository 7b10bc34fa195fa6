"""Iteration-level scheduler: each step it picks the sequences (and token counts) to compute.

Order of business every step, under one token budget (``max_num_batched_tokens``):
1. running sequences that decode (one token each), so a long prompt never stalls them;
2. running sequences still prefilling (a chunk each when chunked prefill is on);
3. waiting sequences, best priority then oldest first, while the budget, ``max_num_seqs`` and the
   free blocks allow (their cached prefix blocks are attached first and cost no compute).
When a running sequence needs a block and none is free, the newest running sequence is preempted by
recompute: its blocks are freed and it goes back to the head of the queue, keeping its tokens.
The result is a plain plan (``SchedulerOutput``) that the model runner executes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for this sequence in this step, from seq.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def plan(self) -> dict[str, int]:
        """``{request_id: num_tokens}``, the vLLM v1 view of a step."""
        return {s.seq.request_id: s.num_tokens for s in self.scheduled}

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of its queue and free its blocks now."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)  # keeps its arrival time, so it is picked again first

    # ----------------------------------------------------------------- step
    def schedule(self) -> SchedulerOutput:
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
            seq = min(self.waiting, key=lambda s: (s.priority, s.arrival_time))
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
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n
        return out
