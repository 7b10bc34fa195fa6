"""Async scheduling: one step in flight, the next launched before the last is waited for.

On CPU the host is the device, so nothing overlaps in time here; what these tests hold is the contract the GPU's
speed rests on: the engine with a step in flight gives every request what the one-step-at-a-time engine gives it
(tokens, text, finish reasons, logprobs), its decode inputs are read from the previous step's ids on the device
(an input left as the placeholder would fail the embedding lookup on CPU), each step still waits once, a request
that ends or is aborted while a later step computes for it loses nothing and leaks no placeholder or block, and the
rows that need their last token on the host (a grammar, penalties) wait for it.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import torch

from serving.cli import add_serve_arguments, engine_config_from_args
from serving.engine import EngineConfig, LLMEngine, SamplingParams
from serving.engine.host_transfer import PinnedStaging
from serving.engine.scheduled_seq import ScheduledSeq
from serving.engine.sequence import PLACEHOLDER, Sequence
from serving.engine.step_inputs import NO_SLOT, DecodeStaticInputs
from serving.engine.structured_output import StructuredOutput


def _engine(model_dir: Path, async_scheduling: bool, **overrides) -> LLMEngine:
    config = EngineConfig(**{"device": "cpu", "num_blocks": 96, "block_size": 4, "async_scheduling": async_scheduling,
                             **overrides})
    return LLMEngine.from_pretrained(model_dir, config)


def _prompts(n: int, seed: int = 0, longest: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(7, 400) for _ in range(rng.randint(2, longest))] for _ in range(n)]


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
         abort_after: dict[str, int] | None = None) -> tuple[dict, dict]:
    """Step until done; returns the final outputs and every streamed delta, by request id. ``abort_after``: request
    id -> the step after which it is aborted."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    done, deltas, steps = {}, {f"r{i}": [] for i in range(len(prompts))}, 0
    while engine.has_unfinished():
        for out in engine.step():
            assert PLACEHOLDER not in out.delta_token_ids and PLACEHOLDER not in out.outputs[0].token_ids
            deltas[out.request_id] += out.delta_token_ids
            if out.finished:
                done[out.request_id] = out
        steps += 1
        for rid, after in (abort_after or {}).items():
            if steps == after:
                engine.abort(rid)
    return done, deltas


def _same_replies(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g = got[rid]
        assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason, g.outputs[0].stop_reason) == \
            (w.outputs[0].token_ids, w.outputs[0].text, w.outputs[0].finish_reason, w.outputs[0].stop_reason), rid


def _mixed_params(n: int, stop_text: str | None = None) -> list[SamplingParams]:
    """Greedy with different lengths, seeded sampling with logprobs, a stop string: what a server's batch holds."""
    rng = random.Random(1)
    params = []
    for i in range(n):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=rng.randint(4, 16),
                                         logprobs=2))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=20, stop=[stop_text] if stop_text else []))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 18)))
    return params


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["cpp kernels", "torch attention"])
@pytest.mark.parametrize("setting", ["roomy", "chunked", "tight"], ids=["roomy", "chunked prefill", "preempting"])
def test_a_step_in_flight_changes_no_reply(tiny_model_dir, backend, setting):
    """Mixed requests, with prefix hits (repeated prompts), chunked prefill beside decodes (a 16-token budget) and
    preemption (a cache too small for the batch): each reply equals the synchronous engine's, and logprobs agree
    to float noise (a batch's make-up differs by a step, which moves the last bits)."""
    overrides = {"roomy": {}, "chunked": {"max_num_batched_tokens": 16},
                 "tight": {"num_blocks": 24, "max_num_batched_tokens": 64}}[setting]
    prompts = _prompts(10) + _prompts(3)  # the last three repeat the first three: prefix-cache hits
    params = _mixed_params(len(prompts))
    want, _ = _run(_engine(tiny_model_dir, False, attention_backend=backend, **overrides), prompts, params)
    text = want["r1"].outputs[0].text
    params = _mixed_params(len(prompts), stop_text=text[3:5])  # a stop string some replies run into
    want, _ = _run(_engine(tiny_model_dir, False, attention_backend=backend, **overrides), prompts, params)
    engine = _engine(tiny_model_dir, True, attention_backend=backend, **overrides)
    got, deltas = _run(engine, prompts, params)
    _same_replies(got, want)
    assert any(o.outputs[0].stop_reason == text[3:5] for o in want.values())
    for rid, out in got.items():
        assert deltas[rid] == out.outputs[0].token_ids  # the stream holds the reply, once each
        if want[rid].outputs[0].logprobs:
            for g, w in zip(out.outputs[0].logprobs, want[rid].outputs[0].logprobs):
                assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-3 for t in w)
    stats = engine.stats()
    assert stats.kv_usage == 0.0 and stats.num_running == 0 and not engine.has_unfinished()
    assert engine.generation_tokens_total == sum(len(o.outputs[0].token_ids) for o in got.values())
    if setting == "tight":
        assert stats.num_preemptions > 0


def test_each_step_is_launched_before_the_last_is_waited_for_and_waits_once(tiny_model_dir):
    engine = _engine(tiny_model_dir, True)
    readback = engine.executor.sampler.readback(engine.runner.device)
    _run(engine, _prompts(4), [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 4)
    assert engine.num_steps == 16  # one prefill step, fifteen decode steps: no step wasted
    assert engine.num_steps_overlapped == engine.num_steps - 1  # all but the last, which nothing follows
    assert readback.waits == engine.num_steps


def test_the_synchronous_engine_waits_for_each_step_before_the_next(tiny_model_dir):
    engine = _engine(tiny_model_dir, False)
    _run(engine, _prompts(4), [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 4)
    assert engine.num_steps == 8 and engine.num_steps_overlapped == 0


def test_a_request_that_stops_loses_nothing_to_the_step_computed_after_it(tiny_model_dir):
    """Its stop token is known only once the next step is under way; that step's token for it is dropped, and
    its blocks and id are free for the next request."""
    prompts = _prompts(3, seed=3)
    free = _run(_engine(tiny_model_dir, False), prompts, [SamplingParams(temperature=0, max_tokens=12)] * 3)[0]
    stop_id = free["r1"].outputs[0].token_ids[4]  # the fifth token of one reply
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id])] * 3
    want, _ = _run(_engine(tiny_model_dir, False), prompts, params)
    engine = _engine(tiny_model_dir, True)
    got, _ = _run(engine, prompts, params)
    _same_replies(got, want)
    assert got["r1"].outputs[0].finish_reason == "stop" and got["r1"].outputs[0].token_ids[-1] == stop_id
    assert engine.stats().kv_usage == 0.0
    again, _ = _run(engine, prompts[:1], params[:1])  # the ids are free again
    assert again["r0"].outputs[0].token_ids == want["r0"].outputs[0].token_ids


def test_an_abort_while_its_step_is_in_flight(tiny_model_dir):
    prompts = _prompts(3, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3
    want, _ = _run(_engine(tiny_model_dir, False), prompts, params)
    engine = _engine(tiny_model_dir, True)
    got, deltas = _run(engine, prompts, params, abort_after={"r1": 5})
    assert got["r1"].outputs[0].finish_reason == "abort"
    cut = got["r1"].outputs[0].token_ids
    assert 0 < len(cut) < 20 and cut == want["r1"].outputs[0].token_ids[:len(cut)] and deltas["r1"] == cut
    for rid in ("r0", "r2"):
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    assert engine.stats().kv_usage == 0.0 and not engine.has_unfinished()


def test_rows_that_need_their_token_on_the_host_wait_for_it(tiny_model_dir):
    """A constrained reply's grammar and a penalty's counts read the last token on the host: a plan holding such
    a row applies the step in flight first, and every reply is the synchronous engine's."""
    prompts = _prompts(3, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput("json_object")),
              SamplingParams(temperature=0, max_tokens=12, presence_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=12)]
    want, _ = _run(_engine(tiny_model_dir, False), prompts, params)
    engine = _engine(tiny_model_dir, True)
    got, _ = _run(engine, prompts, params)
    _same_replies(got, want)
    assert engine.num_steps_overlapped < engine.num_steps - 1
    plain = _engine(tiny_model_dir, True)  # the same plain request alone overlaps every step
    _run(plain, prompts[2:], params[2:])
    assert plain.num_steps_overlapped == plain.num_steps - 1


def test_async_scheduling_is_a_choice_with_clear_limits(tiny_model_dir):
    assert _engine(tiny_model_dir, None).async_scheduling is False  # CPU: the host is the device, nothing overlaps
    with pytest.raises(ValueError, match="^async_scheduling: cannot be on with speculative decoding"):
        EngineConfig(async_scheduling=True, speculative_tokens=4)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for flags, want in (["--async-scheduling"], True), (["--no-async-scheduling"], False), ([], None):
        assert engine_config_from_args(parser.parse_args(["m", *flags])).async_scheduling is want


def test_consecutive_steps_write_different_host_buffers():
    """On a GPU the copy of step N's inputs may still be queued when the host writes step N+1's, so a staging
    buffer alternates between two host buffers (one step in flight at most), the static inputs of decode graphs
    included, each starting as padding."""
    cpu = torch.device("cpu")
    staging = PinnedStaging(cpu, 8)
    seen = []
    for n in (8, 8, 8, 100, 100):
        staging.reserve(n)
        seen.append(staging.host.data_ptr())
    assert seen[0] != seen[1] and seen[0] == seen[2] and seen[3] != seen[4]
    static = DecodeStaticInputs(cpu, 4, 4, 2)
    hosts = []
    for tokens in ([5, 6], [7, 8, 9]):
        seq = Sequence("s", tokens, SamplingParams())
        seq.num_computed_tokens, seq.block_table = len(tokens) - 1, [0]
        static.fill([ScheduledSeq(seq, 1)], 4)
        hosts.append(static.staging.host.data_ptr())
        assert static.ids[0].item() == tokens[-1] and static.slots[1:].eq(NO_SLOT).all()
    assert hosts[0] != hosts[1]
