"""LLMEngine: the step loop tying scheduler, block manager, model runner, sampler and detokenizer.

Thread model: ``add_request`` and ``abort`` may be called from any thread (the API server's event
loop); they only validate and put work into an inbox under a lock. ``step`` runs in one thread (the
server's engine thread or the caller of ``generate``); it drains the inbox, schedules, runs one
forward pass and returns the outputs of that step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifacts.common.stop_tokens import stop_token_ids
from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.draft_model import DraftModelProposer, draft_cache_blocks
from serving.engine.errors import InvalidRequestError, QueueFullError
from serving.engine.generation_defaults import SamplingDefaults, read_sampling_defaults
from serving.engine.limits import RequestLimits, validate_request
from serving.engine.model_runner import ModelRunner
from serving.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from serving.engine.sampler import Sampler, prompt_logprobs
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import ScheduledSeq, Scheduler
from serving.engine.sequence import Sequence
from serving.engine.speculative import (
    LookupThenDraft,
    NgramProposer,
    Proposer,
    SpeculationStats,
    accepted_prefix,
    can_speculate,
)

log = logging.getLogger(__name__)

@dataclass
class _StepResult:
    """What one forward pass computed for a batch, before any sequence's state changes."""

    flags: list[bool]
    prompt_records: dict[int, list[dict[int, float]]]  # scheduled index -> new prompt logprob records
    sampled: dict[int, tuple[int, dict[int, float] | None]]  # scheduled index -> (token, logprob record)
    verified: dict[int, list[int]] = field(default_factory=dict)  # scheduled index -> greedy token per row


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Any, config: EngineConfig,
                 eos_token_ids: frozenset[int] = frozenset(),
                 sampling_defaults: SamplingDefaults = SamplingDefaults()) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.sampling_defaults = sampling_defaults  # the model's, for fields a request leaves out
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
        # the context a request may use: the model's, the config's, and what the KV cache can hold at all
        capacity = runner.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or runner.max_position, runner.max_position, capacity)
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler(seed=config.seed)
        self.seqs: dict[str, Sequence] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._ids_in_use: set[str] = set()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished_total = 0
        self.requests_failed_total = 0
        self.num_steps = 0
        self.proposer = _make_proposer(config, runner, tokenizer)
        self.speculation = SpeculationStats()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        from transformers import AutoTokenizer

        config = config or EngineConfig()
        model_dir = Path(model_dir)
        sampling_defaults = read_sampling_defaults(model_dir)  # a bad file fails before the weights load
        runner = ModelRunner(model_dir, config)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError):
            tokenizer = None  # token-id-only serving
        return cls(runner, tokenizer, config, frozenset(stop_token_ids(model_dir, tokenizer)), sampling_defaults)

    # ----------------------------------------------------------------- requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt: this model has no tokenizer; send token ids")
        return self.tokenizer.encode(prompt)

    @property
    def limits(self) -> RequestLimits:
        c = self.config
        return RequestLimits(self.runner.vocab_size, self.max_model_len, c.max_num_batched_tokens,
                             c.enable_chunked_prefill, c.max_queue)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check a request can ever be served; returns params with ``max_tokens`` resolved."""
        return validate_request(prompt_token_ids, params, self.limits)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Queue a request (thread-safe). Raises InvalidRequestError or QueueFullError (→ 400 / 429)."""
        params = self.validate(list(prompt_token_ids), params or SamplingParams())
        seq = Sequence(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                       priority=priority, arrival_time=arrival_time or time.monotonic())
        with self._lock:
            if request_id in self._ids_in_use:
                raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
            if len(self.scheduler.waiting) + len(self._inbox) >= self.config.max_queue:
                raise QueueFullError(f"queue is full ({self.config.max_queue} requests waiting); retry later",
                                     retry_after=1.0)
            self._ids_in_use.add(request_id)
            self._inbox.append(seq)

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe); its blocks are freed at the start of the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts and self.seqs) or self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- step
    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        outs = []
        for seq in inbox:
            self.seqs[seq.request_id] = seq
            p = seq.params
            try:
                if self.tokenizer is not None:
                    self.detoks[seq.request_id] = IncrementalDetokenizer(
                        self.tokenizer, seq.prompt_token_ids, p.stop, p.skip_special_tokens,
                        p.include_stop_str_in_output)
            except Exception as exc:  # noqa: BLE001 - this request cannot start; the others can
                outs.append(self._fail(seq, exc))
                continue
            if p.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            self.scheduler.add(seq)
            self.prompt_tokens_total += seq.num_prompt_tokens
        for rid in aborts:
            seq = self.seqs.get(rid)
            if seq is None:
                continue
            seq.finish_reason = "abort"
            outs.append(self._finish(seq))
        return outs

    def _finish(self, seq: Sequence, new_ids: list[int] | None = None,
                new_lp: list | None = None) -> RequestOutput:
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.release(seq.request_id)  # a draft model's blocks for it go back now
        self.requests_finished_total += 1
        out = self._output(seq, new_ids or [], new_lp, finished=True)
        self.seqs.pop(seq.request_id, None)
        self.detoks.pop(seq.request_id, None)
        with self._lock:
            self._ids_in_use.discard(seq.request_id)
        return out

    def _output(self, seq: Sequence, new_ids: list[int], new_lp: list | None, finished: bool) -> RequestOutput:
        detok = self.detoks.get(seq.request_id)
        text = detok.text if detok else ""
        delta = detok.delta(finished) if detok else ""
        if detok and not finished and not detok.stopped_on:
            text = text[:detok.emitted]
        comp = CompletionOutput(0, text, seq.output_token_ids,
                                seq.logprobs if seq.params.logprobs is not None else None,
                                seq.finish_reason if finished else None, seq.stop_reason)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, [comp], finished, delta, new_ids, new_lp,
                             seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
                             seq.num_cached_tokens, seq.arrival_time, seq.first_token_time,
                             time.monotonic() if finished else None)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Append-time stop rules; the detokenizer handles stop strings. Sets finish_reason."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return True
            if not p.ignore_eos and token in seq.eos_token_ids:
                seq.finish_reason = "stop"
                return True
        return False

    def _stopped_after(self, seq: Sequence, tok: int) -> bool:
        """Every stop rule for a token just appended: stop ids and eos, stop strings, length."""
        stopped = self._check_stop(seq, tok)
        detok = self.detoks.get(seq.request_id)
        if not stopped and detok is not None:
            hit = detok.add_token(tok)
            if hit is not None:
                seq.finish_reason, seq.stop_reason, stopped = "stop", hit, True
        if not stopped and (seq.num_output_tokens >= seq.params.max_tokens
                            or seq.num_tokens >= self.max_model_len):
            seq.finish_reason, stopped = "length", True
        return stopped

    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration and forward pass; return outputs of every touched request.

        A failure while computing the batch is isolated: each sequence is re-run alone and only those
        that fail alone are finished with ``finish_reason="error"``, so one request's failure fails that
        request and never the engine. A replica whose every request fails (a lost device) still answers
        /health: its 5xx rate is what the gateway ejects it on, and what alerts read from /metrics.
        """
        outputs = self._drain_inbox()
        drafted = self._propose_drafts()
        try:
            plan = self.scheduler.schedule()
            self._fit_drafts(drafted, plan.scheduled)
            if not plan:
                return outputs
            self.num_steps += 1
            scheduled = plan.scheduled
            try:
                started = time.perf_counter()
                result = self._compute(scheduled)
                if drafted:
                    self.proposer.observe_step(time.perf_counter() - started)
            except Exception as exc:  # noqa: BLE001 - isolate whatever went wrong, then decide
                outputs += self._isolate(scheduled, exc)
                return outputs
            outputs += self._commit(scheduled, result)
            return outputs
        finally:
            for seq in drafted:  # a guess never outlives its step, whatever happened in it
                _drop_drafts(seq)

    # ----------------------------------------------------------------- speculative decoding
    def _propose_drafts(self) -> list[Sequence]:
        """Append guessed tokens to the greedy decodes the proposer has guesses for (serving.engine.speculative)."""
        if self.proposer is None:
            return []
        seqs, rooms = [], []
        for seq in self.scheduler.running:
            if not can_speculate(seq):
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if room > 0:
                seqs.append(seq)
                rooms.append(room)
        guesses = self.proposer.propose_many(seqs, rooms)  # called every step: a draft model frees what left
        drafted = []
        for seq in seqs:
            drafts = guesses.get(seq.request_id)
            if drafts:
                seq.draft_token_ids = drafts
                seq.token_ids.extend(drafts)
                drafted.append(seq)
        return drafted

    @staticmethod
    def _fit_drafts(drafted: list[Sequence], scheduled: list[ScheduledSeq]) -> None:
        """Keep the guesses the step computes: none for a sequence the budget or the blocks left out."""
        computed = {id(item.seq): item.num_tokens for item in scheduled}
        for seq in drafted:
            keep = computed.get(id(seq), 1) - 1
            if keep < len(seq.draft_token_ids):
                del seq.token_ids[len(seq.token_ids) - len(seq.draft_token_ids) + keep:]
                seq.draft_token_ids = seq.draft_token_ids[:keep]

    def _commit_verified(self, item: ScheduledSeq, greedy: list[int], now: float) -> RequestOutput | None:
        """Emit the guesses the model agreed with and its own next token, through the usual stop rules."""
        seq = item.seq
        drafts = seq.draft_token_ids
        emitted = accepted_prefix(drafts, greedy)
        _drop_drafts(seq)
        if self.proposer is not None:
            self.proposer.observe(seq.request_id, len(drafts), len(emitted) - 1)
        self.speculation.steps += 1
        self.speculation.drafted += len(drafts)
        self.speculation.accepted += len(emitted) - 1
        # the KV of the last real token and of every kept guess is in the cache now
        computed = seq.num_computed_tokens + len(emitted)
        new_ids: list[int] = []
        stopped = False
        for tok in emitted:
            seq.token_ids.append(tok)
            new_ids.append(tok)
            self.generation_tokens_total += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            stopped = self._stopped_after(seq, tok)
            if stopped:
                break
        seq.num_computed_tokens = min(computed, seq.num_tokens)
        self.block_manager.commit_full_blocks(seq)
        if stopped:
            return self._finish(seq, new_ids)
        return self._output(seq, new_ids, None, finished=False)

    def _compute(self, scheduled: list[ScheduledSeq]) -> _StepResult:
        """Forward and sample for a batch. Changes no sequence state (KV writes are idempotent), so a
        failed batch can be re-run piecewise."""
        flags, verify = [], []
        for item in scheduled:
            seq = item.seq
            done_prefill = seq.num_computed_tokens + item.num_tokens == seq.num_tokens
            verify.append(bool(seq.draft_token_ids))
            flags.append(done_prefill and seq.params.max_tokens > 0 and not verify[-1])
        step_logits = self.runner.execute(scheduled, flags, verify if any(verify) else None)
        prompt_records = {}
        for i, first, logits in step_logits.prompt_logits:
            seq = scheduled[i].seq
            nxt = seq.prompt_token_ids[first:first + logits.shape[0]]
            prompt_records[i] = (first, prompt_logprobs(logits, nxt, seq.params.prompt_logprobs))
        sampled = {}
        if step_logits.sample_rows:
            seqs = [scheduled[i].seq for i in step_logits.sample_rows]
            res = self.sampler(step_logits.sample_logits, seqs)
            sampled = {i: (tok, lp) for i, tok, lp in zip(step_logits.sample_rows, res.token_ids, res.logprobs)}
        verified = {i: logits.argmax(-1).tolist() for i, logits in step_logits.verify_logits.items()}
        return _StepResult(flags, prompt_records, sampled, verified)

    def _commit(self, scheduled: list[ScheduledSeq], result: _StepResult) -> list[RequestOutput]:
        """Apply a computed step to each sequence; a failure here fails that sequence alone."""
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for i, item in enumerate(scheduled):
            seq = item.seq
            try:
                if i in result.verified:
                    out = self._commit_verified(item, result.verified[i], now)
                else:
                    out = self._commit_one(item, result.flags[i], result.prompt_records.get(i),
                                           result.sampled.get(i), now)
            except Exception as exc:  # noqa: BLE001 - a bug for this request only
                out = self._fail(seq, exc)
            if out is not None:
                outputs.append(out)
        return outputs

    def _commit_one(self, item: ScheduledSeq, sample_flag: bool, prompt_records, sampled,
                    now: float) -> RequestOutput | None:
        seq = item.seq
        seq.num_computed_tokens += item.num_tokens
        self.block_manager.commit_full_blocks(seq)
        if prompt_records is not None:
            first, recs = prompt_records
            for r, rec in enumerate(recs):
                if first + r == len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append(rec)
        if not sample_flag:
            # prefill-only requests (max_tokens == 0) finish once their prompt is computed
            if seq.params.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                seq.finish_reason = "length"
                return self._finish(seq)
            return None
        tok, lp = sampled
        seq.token_ids.append(tok)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if lp is not None:
            seq.logprobs.append(lp)
        stopped = self._stopped_after(seq, tok)
        lps = [lp] if lp is not None else None
        if stopped:
            return self._finish(seq, [tok], lps)
        return self._output(seq, [tok], lps, finished=False)

    def _isolate(self, scheduled: list[ScheduledSeq], batch_error: Exception) -> list[RequestOutput]:
        """Re-run each sequence of a failed batch alone; fail only those that fail alone."""
        if len(scheduled) == 1:
            return [self._fail(scheduled[0].seq, batch_error)]
        outputs: list[RequestOutput] = []
        failed = 0
        for item in scheduled:
            try:
                result = self._compute([item])
            except Exception as exc:  # noqa: BLE001
                outputs.append(self._fail(item.seq, exc))
                failed += 1
                continue
            outputs += self._commit([item], result)
        if failed == 0:
            log.warning("engine step failed as a batch but not per sequence (%s: %s); every request went on",
                        type(batch_error).__name__, batch_error)
        return outputs

    def _fail(self, seq: Sequence, exc: BaseException) -> RequestOutput:
        """Finish one sequence because computing it raised: free its blocks, report the error."""
        log.error("request %s failed inside the engine: %s: %s", seq.request_id, type(exc).__name__, exc,
                  exc_info=exc)
        self.requests_failed_total += 1
        seq.finish_reason = "error"
        out = self._finish(seq)
        out.error = f"{type(exc).__name__}: {exc}"
        return out

    # ----------------------------------------------------------------- batch API
    def generate(self, prompts: Seq[str] | Seq[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Blocking batch generation; returns one finished RequestOutput per prompt, in order."""
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"params: got {len(plist)} for {len(prompts)} prompts")
        ids = []
        base = f"gen-{time.monotonic_ns()}"
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            toks = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"{base}-{i}"
            ids.append(rid)
            self._add_blocking(rid, toks, p)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]

    def _add_blocking(self, rid: str, toks: list[int], p: SamplingParams) -> None:
        """add_request that steps the engine while the queue is full instead of failing."""
        while True:
            try:
                self.add_request(rid, toks, p)
                return
            except QueueFullError:
                self.step()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(num_running=len(self.scheduler.running),
                           num_waiting=len(self.scheduler.waiting) + len(self._inbox),
                           kv_usage=bm.usage(), prefix_cache_hits=bm.prefix_cache_hits,
                           prefix_cache_queries=bm.prefix_cache_queries,
                           num_preemptions=self.scheduler.num_preemptions, num_blocks=bm.num_blocks,
                           block_size=bm.block_size, num_free_blocks=bm.num_free_blocks,
                           prompt_tokens_total=self.prompt_tokens_total,
                           generation_tokens_total=self.generation_tokens_total,
                           requests_finished_total=self.requests_finished_total, num_steps=self.num_steps,
                           spec_draft_tokens_total=self.speculation.drafted,
                           spec_accepted_tokens_total=self.speculation.accepted,
                           spec_draft_cost_ratio=(self.proposer and self.proposer.draft_cost_ratio) or 0.0)


def _make_proposer(config: EngineConfig, runner: ModelRunner, tokenizer: Any) -> Proposer | None:
    """The source of guesses: n-gram lookup; or a draft model when ``speculative_model`` names one, with the
    lookup's guesses first where the context repeats unless ``speculative_lookup`` is off."""
    if not config.speculative_tokens:
        return None
    if config.speculative_model is None:
        return NgramProposer(config.speculative_tokens, config.speculative_ngram)
    draft = DraftModelProposer(config.speculative_model, config, runner.vocab_size, tokenizer,
                               draft_cache_blocks(config, runner.num_blocks))
    if not config.speculative_lookup:
        return draft
    return LookupThenDraft(NgramProposer(config.speculative_tokens, config.speculative_ngram), draft)


def _drop_drafts(seq: Sequence) -> None:
    """Take a sequence's pending guesses off the end of its tokens."""
    if seq.draft_token_ids:
        del seq.token_ids[len(seq.token_ids) - len(seq.draft_token_ids):]
        seq.draft_token_ids = []
