"""Runs a plan: one forward pass and the sampling after it, with no change to any sequence's state.

Why apart from the scheduler: a forward that raises must fail only the request that makes it raise. Since
executing changes nothing (KV writes are idempotent), a failed batch is simply re-run one sequence at a
time, and only the sequences that fail alone carry an error into ``ModelOutput``; the scheduler then
commits the others as if the batch had not failed. A device error (``device_errors.is_device_error``) is the
exception: it poisons the CUDA context for every request, so it is raised out of the step, never isolated.
"""

from __future__ import annotations

import logging
import time

from serving.engine.device_errors import is_device_error
from serving.engine.model_runner import ModelRunner
from serving.engine.outputs import ModelOutput
from serving.engine.sampler import Sampler, prompt_logprobs
from serving.engine.scheduled_seq import ScheduledSeq
from serving.engine.structured_output import start_fill

log = logging.getLogger(__name__)


class ModelExecutor:
    """Forward and sample for the scheduled sequences (vLLM v1's executor, in-process)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler

    def execute(self, scheduled: list[ScheduledSeq]) -> ModelOutput:
        """What the step computed; never raises for a sequence's sake, only for the device's (see the module
        docstring)."""
        started = time.perf_counter()
        try:
            out = self._compute(scheduled)
        except Exception as exc:  # noqa: BLE001 - isolate whatever went wrong, then decide
            if is_device_error(exc):
                raise
            return self._isolate(scheduled, exc)
        out.forward_seconds = time.perf_counter() - started
        return out

    def _compute(self, scheduled: list[ScheduledSeq]) -> ModelOutput:
        flags, verify = [], []
        for item in scheduled:
            seq = item.seq
            done_prefill = seq.num_computed_tokens + item.num_tokens == seq.num_tokens
            verify.append(bool(seq.draft_token_ids))
            flags.append(done_prefill and seq.params.max_tokens > 0 and not verify[-1])
        # the grammar masks of the rows that sample are filled while the forward runs (start_fill says why)
        matchers = [item.seq.grammar for item, f in zip(scheduled, flags) if f and item.seq.grammar is not None]
        masks = start_fill(matchers, self.runner.vocab_size) if matchers else None
        step_logits = self.runner.execute(scheduled, flags, verify if any(verify) else None)
        prompt_records = {}
        for i, first, logits in step_logits.prompt_logits:
            seq = scheduled[i].seq
            nxt = seq.prompt_token_ids[first:first + logits.shape[0]]
            prompt_records[i] = (first, prompt_logprobs(logits, nxt, seq.params.prompt_logprobs))
        sampled = {}
        # the model's own token at every guessed position; read back in the sampler's one wait
        verify_rows = list(step_logits.verify_logits)
        verify_ids = [step_logits.verify_logits[i].argmax(-1) for i in verify_rows]
        if step_logits.sample_rows:
            seqs = [scheduled[i].seq for i in step_logits.sample_rows]
            constrained = {"grammar_masks": masks} if masks is not None else {}
            res = self.sampler(step_logits.sample_logits, seqs, verify_ids, **constrained)
            sampled = {i: (tok, lp) for i, tok, lp in zip(step_logits.sample_rows, res.token_ids, res.logprobs)}
            verify_lists = res.extra
        else:
            verify_lists = self.sampler.readback(self.runner.device).fetch(*verify_ids) if verify_ids else []
        return ModelOutput(flags, prompt_records, sampled, dict(zip(verify_rows, verify_lists)))

    def _isolate(self, scheduled: list[ScheduledSeq], batch_error: Exception) -> ModelOutput:
        """Re-run each sequence of a failed batch alone; only those that fail alone get an error."""
        out = ModelOutput([False] * len(scheduled))
        if len(scheduled) == 1:
            out.errors[0] = batch_error
            return out
        for i, item in enumerate(scheduled):
            try:
                alone = self._compute([item])
            except Exception as exc:  # noqa: BLE001
                if is_device_error(exc):
                    raise
                out.errors[i] = exc
                continue
            out.sample_flags[i] = alone.sample_flags[0]
            for mine, theirs in ((out.prompt_records, alone.prompt_records), (out.sampled, alone.sampled),
                                 (out.verified, alone.verified)):
                if 0 in theirs:
                    mine[i] = theirs[0]
        if not out.errors:
            log.warning("engine step failed as a batch but not per sequence (%s: %s); every request went on",
                        type(batch_error).__name__, batch_error)
        return out
