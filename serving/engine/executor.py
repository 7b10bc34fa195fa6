"""Runs a plan: one forward pass and the sampling after it, with no change to any sequence's state.

Why apart from the scheduler: a forward that raises must fail only the request that makes it raise. Since
executing changes nothing (KV writes are idempotent), a failed batch is simply re-run one sequence at a
time, and only the sequences that fail alone carry an error into ``ModelOutput``; the scheduler then
commits the others as if the batch had not failed. A device error (``device_errors.is_device_error``) is the
exception: it poisons the CUDA context for every request, so it is raised out of the step, never isolated.

``launch`` starts a step and returns at once with a ``LaunchedStep``: the sampled ids stay on the device until
``result()`` waits for them. With async scheduling (``engine``) the next step is launched before that wait, its
decode inputs read from the previous step's ids on the device (``TokenFill``), so the host's work between steps
(applying the last step, scheduling the next) runs while the device computes.
"""

from __future__ import annotations

import logging
import time

import torch

from serving.engine.device_errors import is_device_error
from serving.engine.host_transfer import PendingReadback
from serving.engine.model_runner import ModelRunner, TokenFill
from serving.engine.outputs import ModelOutput
from serving.engine.sampler import PendingSample, Sampler, prompt_logprobs
from serving.engine.scheduled_seq import ScheduledSeq
from serving.engine.sequence import PLACEHOLDER
from serving.engine.structured_output import start_fill

log = logging.getLogger(__name__)


def sample_flags(scheduled: list[ScheduledSeq]) -> list[bool]:
    """Per item: it samples a token this step (its prompt is then computed to the end, it may generate, and it
    checks no guesses)."""
    flags = []
    for item in scheduled:
        seq = item.seq
        done_prefill = seq.num_computed_tokens + item.num_tokens == seq.num_tokens
        flags.append(done_prefill and seq.params.max_tokens > 0 and not seq.draft_token_ids)
    return flags


class LaunchedStep:
    """A step whose forward and sampling are under way: ``sampled_on_device`` is what the next step's inputs may
    read before anything waits; ``result()`` waits once and gives the ``ModelOutput``."""

    def __init__(self, scheduled: list[ScheduledSeq], flags: list[bool], output: ModelOutput,
                 sample_rows: list[int] | None = None, pending: PendingSample | None = None,
                 verify_rows: list[int] | None = None, verify_pending: PendingReadback | None = None) -> None:
        self.scheduled = scheduled
        self.sample_flags = flags
        self.output = output  # complete once ``result()`` has returned
        self._sample_rows = sample_rows or []
        self._pending = pending
        self._verify_rows = verify_rows or []
        self._verify_pending = verify_pending
        self._done = pending is None and verify_pending is None
        self._source: tuple[object, dict[int, int]] | None = None

    def sampled_on_device(self) -> tuple[object, dict[int, int]] | None:
        """(the device tensor of sampled ids, ``id(seq)`` -> its row), or None when the ids are only on the host
        (a batch re-run per sequence, or a step that sampled nothing). Built once: the engine and the next launch
        both ask."""
        if self._pending is None:
            return None
        if self._source is None:
            self._source = self._pending.token_ids, {id(self.scheduled[i].seq): j
                                                     for j, i in enumerate(self._sample_rows)}
        return self._source

    def result(self) -> ModelOutput:
        out = self.output
        if self._done:
            return out
        self._done = True
        if self._pending is not None:
            res = self._pending.result()
            out.sampled = {i: (tok, lp) for i, tok, lp in zip(self._sample_rows, res.token_ids, res.logprobs)}
            verify_lists = res.extra
        else:
            verify_lists = self._verify_pending.wait()
        out.verified = dict(zip(self._verify_rows, verify_lists))
        return out


class ModelExecutor:
    """Forward and sample for the scheduled sequences (vLLM v1's executor, in-process)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler

    def execute(self, scheduled: list[ScheduledSeq]) -> ModelOutput:
        """What the step computed, waited for (``launch`` then ``result``)."""
        return self.launch(scheduled).result()

    def launch(self, scheduled: list[ScheduledSeq], previous: LaunchedStep | None = None) -> LaunchedStep:
        """Start the step; never raises for a sequence's sake, only for the device's (see the module docstring).
        ``previous``: the step still in flight, whose sampled ids on the device feed this one's decode rows."""
        started = time.perf_counter()
        flags = sample_flags(scheduled)
        source = previous.sampled_on_device() if previous is not None else None
        try:
            step = self._launch(scheduled, flags, source)
        except Exception as exc:  # noqa: BLE001 - isolate whatever went wrong, then decide
            if is_device_error(exc):
                raise
            return LaunchedStep(scheduled, flags, self._isolate(scheduled, flags, source, exc))
        step.output.forward_seconds = time.perf_counter() - started
        return step

    def _launch(self, scheduled: list[ScheduledSeq], flags: list[bool],
                source: tuple[object, dict[int, int]] | None) -> LaunchedStep:
        verify = [bool(item.seq.draft_token_ids) for item in scheduled]
        # the grammar masks of the rows that sample are filled while the forward runs (start_fill says why)
        matchers = [item.seq.grammar for item, f in zip(scheduled, flags) if f and item.seq.grammar is not None]
        masks = start_fill(matchers, self.runner.vocab_size) if matchers else None
        step_logits = self.runner.execute(scheduled, flags, verify if any(verify) else None,
                                          fill=_token_fill(scheduled, source))
        prompt_records = {}
        for i, first, logits in step_logits.prompt_logits:
            seq = scheduled[i].seq
            nxt = seq.prompt_token_ids[first:first + logits.shape[0]]
            prompt_records[i] = (first, prompt_logprobs(logits, nxt, seq.params.prompt_logprobs))
        output = ModelOutput(flags, prompt_records)
        # the model's own token at every guessed position; read back in the sampler's one wait
        verify_rows = list(step_logits.verify_logits)
        verify_ids = [step_logits.verify_logits[i].argmax(-1) for i in verify_rows]
        if step_logits.sample_rows:
            seqs = [scheduled[i].seq for i in step_logits.sample_rows]
            constrained = {"grammar_masks": masks} if masks is not None else {}
            pending = self.sampler.launch(step_logits.sample_logits, seqs, verify_ids, **constrained)
            return LaunchedStep(scheduled, flags, output, step_logits.sample_rows, pending, verify_rows)
        verify_pending = self.sampler.readback(self.runner.device).start(*verify_ids) if verify_ids else None
        return LaunchedStep(scheduled, flags, output, verify_rows=verify_rows, verify_pending=verify_pending)

    def _isolate(self, scheduled: list[ScheduledSeq], flags: list[bool], source: tuple[object, dict[int, int]] | None,
                 batch_error: Exception) -> ModelOutput:
        """Re-run each sequence of a failed batch alone; only those that fail alone get an error."""
        out = ModelOutput([False] * len(scheduled))
        if len(scheduled) == 1:
            out.errors[0] = batch_error
            return out
        if self.runner.device.type == "cuda":
            # each re-run writes the staging buffers anew, and the step in flight may not have copied its own yet
            torch.cuda.synchronize(self.runner.device)
        for i, item in enumerate(scheduled):
            try:
                alone = self._launch([item], [flags[i]], source).result()
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


def _token_fill(scheduled: list[ScheduledSeq], source: tuple[object, dict[int, int]] | None) -> TokenFill | None:
    """The input rows whose token is a PLACEHOLDER (sampled by the step in flight) and where that step's ids hold
    each; None when no row waits on one."""
    rows, src = [], []
    row = 0
    for item in scheduled:
        seq = item.seq
        if seq.num_pending and PLACEHOLDER in seq.token_ids[seq.num_computed_tokens:
                                                           seq.num_computed_tokens + item.num_tokens]:
            if item.num_tokens != 1 or source is None or id(seq) not in source[1]:
                raise RuntimeError(f"request {seq.request_id}: its input is a token the previous step has not "
                                   "sampled on the device (async scheduling bug)")
            rows.append(row)
            src.append(source[1][id(seq)])
        row += item.num_tokens
    if not rows:
        return None
    return TokenFill(rows, src, source[0])
