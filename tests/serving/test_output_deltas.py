"""Outputs over the pipe as deltas: the API side assembles exactly what the engine would have handed a handler
in one process, and a step's message does not grow with the length of the requests in it."""

from __future__ import annotations

import pickle
import time

import pytest

from serving.engine import EngineConfig, LLMEngine, SamplingParams
from serving.engine.output_deltas import DeltaEncoder, OutputAssembler

PROMPTS = {
    "plain": [40, 41, 42, 43],
    "logprobs": [50, 51, 52],
    "prompt-logprobs": [60, 61, 62, 63, 64, 65],
    "prefill-only": [70, 71, 72],
    "stop-string": [80, 81],
    "aborted": [90, 91, 92],
}
PARAMS = {
    "plain": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    "logprobs": SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True, logprobs=3),
    "prompt-logprobs": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=2),
    "prefill-only": SamplingParams(max_tokens=0, prompt_logprobs=1),
    "stop-string": SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True, stop=["e", " "]),
    "aborted": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # a small batch budget: prompts are chunked, and the step that starts "prompt-logprobs" is not its first
    return LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=64, block_size=4,
                                                                  max_num_batched_tokens=5))


def test_the_assembled_outputs_are_the_engines_and_each_step_sends_only_what_is_new(engine):
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    for rid, prompt in PROMPTS.items():  # as the core process adds them: with the API side's arrival time
        arrival = time.monotonic()
        engine.add_request(rid, prompt, PARAMS[rid], arrival_time=arrival)
        assembler.add(rid, list(prompt), PARAMS[rid], arrival)

    finished: dict[str, object] = {}
    prompt_records_sent: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 4:
            engine.abort("aborted")
        for o in engine.step():
            delta = pickle.loads(pickle.dumps(encoder.encode(o)))
            if delta.prompt_logprobs is not None:
                prompt_records_sent[o.request_id] = prompt_records_sent.get(o.request_id, 0) + 1
            rebuilt = assembler.assemble(delta)
            assert rebuilt == o, o.request_id  # every field: ids, text, logprobs, prompt logprobs, times
            if o.finished:
                finished[o.request_id] = o
    assert set(finished) == set(PROMPTS) and len(assembler) == 0  # nothing left behind on the API side
    assert prompt_records_sent == {"prompt-logprobs": 1, "prefill-only": 1}  # once each, and complete
    assert len(finished["prompt-logprobs"].prompt_logprobs) == len(PROMPTS["prompt-logprobs"])
    assert finished["aborted"].finish_reason == "abort"
    assert finished["stop-string"].outputs[0].stop_reason in ("e", " ")


def test_a_steps_delta_does_not_grow_with_the_request(engine):
    """A request with logprobs: its full output grows by a record per step, its delta stays flat (O(1) per
    step, not O(L))."""
    encoder = DeltaEncoder()
    engine.add_request("long", [40, 41, 42], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                             logprobs=5))
    sizes = []
    while engine.has_unfinished():
        for o in engine.step():
            sizes.append((len(pickle.dumps(encoder.encode(o))), len(pickle.dumps(o))))
    assert len(sizes) == 40
    deltas, fulls = zip(*sizes[1:], strict=True)
    assert fulls[-1] - fulls[0] > 2000  # 38 more records of 6 (id, logprob) pairs in the full output
    assert max(deltas) - min(deltas) < 40  # the delta: one id, one record, a few characters, whatever the length


def test_a_request_the_core_refuses_leaves_nothing_behind():
    assembler = OutputAssembler()
    assembler.add("r", [1, 2], SamplingParams(), 0.0)
    assembler.discard("r")
    assert len(assembler) == 0
