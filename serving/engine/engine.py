"""LLMEngine: requests in, outputs out; each step is schedule, execute, update from the output (vLLM v1).

The engine is the front: it validates requests, gives each a detokenizer, and runs the step loop. What a
step computes is the scheduler's plan (``Scheduler.schedule``); the executor runs it (``ModelExecutor``);
the scheduler applies the result (``Scheduler.update_from_output``): tokens, guesses, stop rules, blocks.

Async scheduling (``EngineConfig.async_scheduling``, on by default on a GPU): one step stays in flight. A step
launches step N+1 (its decode inputs read from step N's sampled ids on the device) before it waits for step N and
applies it, so the host's work between steps (detokenizing, stop rules, outputs, the next plan) runs while the GPU
computes, as in vLLM v1. A step whose plan needs step N's tokens on the host (a grammar to advance, penalties to
count) applies step N first. A request that step N ends has one more token computed for it by N+1, dropped.

Thread model: ``add_request`` and ``abort`` may be called from any thread (the API server's event
loop); they only validate and put work into an inbox under a lock. ``step`` runs in one thread (the
server's engine thread or the caller of ``generate``); it drains the inbox, schedules, runs one
forward pass and returns the outputs of that step.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artifacts.common.stop_tokens import stop_token_ids
from serving.engine.config import EngineConfig
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.device_memory import derive_max_model_len
from serving.engine.draft_model import DraftModelProposer, draft_cache_blocks
from serving.engine.errors import InvalidRequestError, QueueFullError, UnknownAdapterError
from serving.engine.executor import LaunchedStep, ModelExecutor
from serving.engine.generation_defaults import SamplingDefaults, read_sampling_defaults
from serving.engine.limits import RequestLimits, validate_request
from serving.engine.lora import LoraAdapter
from serving.engine.model_runner import ModelRunner
from serving.engine.outputs import EngineStats, RequestOutput
from serving.engine.sampler import Sampler
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import Scheduler, SchedulerOutput
from serving.engine.sequence import Sequence, SequenceStatus
from serving.engine.speculative import LookupThenDraft, NgramProposer, Proposer, SpeculationStats
from serving.engine.structured_output import GrammarCache, start_matcher


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Any, config: EngineConfig,
                 eos_token_ids: frozenset[int] = frozenset(),
                 sampling_defaults: SamplingDefaults = SamplingDefaults()) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.sampling_defaults = sampling_defaults  # the model's, for fields a request leaves out
        self.eos_token_ids = eos_token_ids
        # the context a request may use: the config's, else the model's as far as the KV cache holds it
        self.max_model_len = derive_max_model_len(runner.max_position, config.max_model_len, runner.num_blocks,
                                                  config.block_size, runner.cache_flag)
        self.executor = ModelExecutor(runner, Sampler(seed=config.seed))
        # one step in flight (the module docstring); on by default where the device runs apart from the host
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else runner.device.type == "cuda" and not config.speculative_tokens
        self._in_flight: InFlightStep | None = None
        self.num_steps_overlapped = 0  # steps whose wait ran while the next step was already launched
        self.scheduler = Scheduler(config, runner.num_blocks, self.max_model_len,
                                   _make_proposer(config, runner, tokenizer), lora=runner.lora)
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._ids_in_use: set[str] = set()
        self._grammar_cache: GrammarCache | None = None
        self.num_steps = 0

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        from transformers import AutoTokenizer

        config = config or EngineConfig()
        model_dir = Path(model_dir)
        sampling_defaults = read_sampling_defaults(model_dir)  # a bad file fails before the weights load
        runner = ModelRunner(model_dir, config)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), **_known_config(model_dir, runner))
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
                    priority: int = 0, arrival_time: float | None = None, lora: str | None = None) -> None:
        """Queue a request (thread-safe), on the base or on the loaded adapter ``lora``. Raises
        InvalidRequestError, UnknownAdapterError or QueueFullError (→ 400 / 404 / 429)."""
        params = self.validate(list(prompt_token_ids), params or SamplingParams())
        seq = Sequence(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                       priority=priority, arrival_time=arrival_time or time.monotonic(),
                       lora=None if lora is None else self._adapter(lora))
        if params.structured is not None:
            seq.grammar = start_matcher(self._grammars(), params.structured, seq.prompt_token_ids)
        with self._lock:
            if request_id in self._ids_in_use:
                raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
            if len(self.scheduler.waiting) + len(self._inbox) >= self.config.max_queue:
                raise QueueFullError(f"queue is full ({self.config.max_queue} requests waiting); retry later",
                                     retry_after=1.0)
            self._ids_in_use.add(request_id)
            self._inbox.append(seq)

    # ----------------------------------------------------------------- adapters
    def _adapter(self, name: str) -> LoraAdapter:
        adapter = self.runner.lora.registered.get(name) if self.runner.lora is not None else None
        if adapter is None:
            raise UnknownAdapterError(f"model: no adapter {name!r} is loaded")
        return adapter

    def load_lora(self, name: str, directory: str | Path) -> LoraAdapter:
        """Read a PEFT adapter and make it servable (thread-safe; the read runs in the caller's thread, off the
        engine loop, which goes on serving). Raises LoraError (a bad or mismatched adapter) or
        InvalidRequestError (adapters off)."""
        if self.runner.lora is None:
            raise InvalidRequestError("lora_name: adapters are off on this server (start it with --max-loras N)")
        adapter = self.runner.lora.read(name, directory)
        with self._lock:
            self.runner.lora.register(adapter)
        return adapter

    def unload_lora(self, name: str) -> None:
        """Refuse new requests for ``name``; requests already accepted finish on it."""
        with self._lock:
            if self.runner.lora is None or name not in self.runner.lora.registered:
                raise UnknownAdapterError(f"lora_name: no adapter {name!r} is loaded")
            self.runner.lora.unregister(name)

    @property
    def loras(self) -> dict[str, LoraAdapter]:
        return dict(self.runner.lora.registered) if self.runner.lora is not None else {}

    def _grammars(self) -> GrammarCache:
        """The schema compiler, made on the first constrained request (llguidance loads only when used)."""
        if self._grammar_cache is None:
            if self.tokenizer is None:
                raise InvalidRequestError("response_format: this model has no tokenizer to constrain")
            self._grammar_cache = GrammarCache(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        return self._grammar_cache

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe); its blocks are freed at the start of the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts and self.scheduler.requests) or self.scheduler.has_unfinished() \
                or self._in_flight is not None

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration: take in new requests and aborts, then schedule, execute, update from the output.

        A failure while computing the batch is isolated: each sequence is re-run alone and only those
        that fail alone are finished with ``finish_reason="error"``, so one request's failure fails that
        request and never the engine. A device error (a CUDA error, ``serving.engine.device_errors``) is not
        isolated: it poisons the device for every request, so it is raised from here, and the engine-core
        process exits with it (the replica is replaced).
        """
        outputs = self._drain_inbox()
        previous, self._in_flight = self._in_flight, None
        plan = self.scheduler.schedule()
        try:
            if previous is not None and not self._can_overlap(previous, plan):
                outputs += self._apply(previous)
                previous = None
                plan.scheduled = [item for item in plan.scheduled if item.seq.status == SequenceStatus.RUNNING]
            launched = None
            if plan:
                self.num_steps += 1
                launched = InFlightStep(plan, self.executor.launch(plan.scheduled,
                                                                   previous.step if previous else None))
                self.scheduler.launched(plan, launched.step.sample_flags)
            if previous is not None:
                self.num_steps_overlapped += launched is not None
                outputs += self._apply(previous)
            if launched is not None:
                if self.async_scheduling:
                    self._in_flight = launched
                else:
                    outputs += self._apply(launched)
            return outputs
        finally:
            plan.drop_drafts()  # a guess never outlives its step, whatever happened in it
            self._forget_finished()

    def _can_overlap(self, previous: InFlightStep, plan: SchedulerOutput) -> bool:
        """Whether ``plan`` can be launched before ``previous`` is applied: its ids are on the device, and no
        sequence waiting on one of them needs the token on the host first (a grammar to advance, penalties)."""
        if not plan or previous.step.sampled_on_device() is None:
            return False
        return not any(item.seq.num_pending and (item.seq.grammar is not None or item.seq.params.has_penalties)
                       for item in plan.scheduled)

    def _apply(self, step: InFlightStep) -> list[RequestOutput]:
        """Wait for a launched step and apply it to its sequences."""
        return self.scheduler.update_from_output(step.plan, step.step.result())

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        outs = []
        for seq in inbox:
            p = seq.params
            try:
                if self.tokenizer is not None:
                    seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.stop,
                                                             p.skip_special_tokens, p.include_stop_str_in_output)
            except Exception as exc:  # noqa: BLE001 - this request cannot start; the others can
                outs.append(self.scheduler.fail(seq, exc))
                continue
            if p.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            self.scheduler.add(seq)
        for rid in aborts:
            out = self.scheduler.abort(rid)
            if out is not None:
                outs.append(out)
        return outs

    def _forget_finished(self) -> None:
        """Let the ids of the requests finished in this step be used again."""
        done = self.scheduler.finished_ids
        if done:
            with self._lock:
                self._ids_in_use.difference_update(done)
            done.clear()

    # ----------------------------------------------------------------- batch API
    def generate(self, prompts: Seq[str] | Seq[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 loras: Seq[str | None] | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Blocking batch generation; returns one finished RequestOutput per prompt, in order. ``loras``: the
        adapter of each prompt (None: the base); ``on_finished`` is called with each output as it finishes (a
        progress bar)."""
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"params: got {len(plist)} for {len(prompts)} prompts")
        adapters = list(loras) if loras is not None else [None] * len(prompts)
        if len(adapters) != len(prompts):
            raise InvalidRequestError(f"loras: got {len(adapters)} for {len(prompts)} prompts")
        ids = []
        base = f"gen-{time.monotonic_ns()}"
        done: dict[str, RequestOutput] = {}
        for i, (prompt, p, lora) in enumerate(zip(prompts, plist, adapters)):
            toks = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"{base}-{i}"
            ids.append(rid)
            self._add_blocking(rid, toks, p, lora, done, on_finished)
        while len(done) < len(ids):
            self._collect(self.step(), done, on_finished)
        return [done[r] for r in ids]

    def _add_blocking(self, rid: str, toks: list[int], p: SamplingParams, lora: str | None,
                      done: dict[str, RequestOutput], on_finished: Callable[[RequestOutput], None] | None) -> None:
        """add_request that steps the engine while the queue is full instead of failing; what those steps
        finish goes into ``done`` (more prompts than ``max_queue`` finish some before the last is queued)."""
        while True:
            try:
                self.add_request(rid, toks, p, lora=lora)
                return
            except QueueFullError:
                self._collect(self.step(), done, on_finished)

    @staticmethod
    def _collect(outputs: list[RequestOutput], done: dict[str, RequestOutput],
                 on_finished: Callable[[RequestOutput], None] | None) -> None:
        for out in outputs:
            if out.finished:
                done[out.request_id] = out
                if on_finished is not None:
                    on_finished(out)

    def stats(self) -> EngineStats:
        return self.scheduler.make_stats(len(self._inbox), self.num_steps, self.num_steps_overlapped)

    # ----------------------------------------------------------------- what callers read
    @property
    def proposer(self) -> Proposer | None:
        return self.scheduler.speculator.proposer

    @property
    def speculation(self) -> SpeculationStats:
        return self.scheduler.speculator.stats

    @property
    def generation_tokens_total(self) -> int:
        return self.scheduler.generation_tokens_total

    @property
    def requests_failed_total(self) -> int:
        return self.scheduler.requests_failed_total


@dataclass
class InFlightStep:
    """A launched step and the plan it runs."""

    plan: SchedulerOutput
    step: LaunchedStep


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



def _known_config(model_dir: Path, runner: ModelRunner) -> dict:
    """``config=`` for ``AutoTokenizer`` when the runner read a plain checkpoint's config itself and the tokenizer
    names its class: AutoTokenizer then skips ``AutoConfig``, whose config classes import ``torch._dynamo`` (3 s of
    a start on the 2-core host), and picks the class by the same names (the model type, the declared class).
    Without a declared class it loads the config itself, as before."""
    from serving.engine.llama_checkpoint import CheckpointConfig

    config = runner.model.config
    if not isinstance(config, CheckpointConfig):
        return {}
    try:
        declared = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return {}
    return {"config": config} if declared else {}
