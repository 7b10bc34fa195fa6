"""One request's failure inside the engine fails that request, never the engine or its batch-mates.

The faults here are injected on purpose (a sampler or detokenizer that raises for one marked request),
standing in for whatever bug a future request shape might hit; the rest is the real engine.
"""

from __future__ import annotations

import pytest

from serving.engine import EngineConfig, LLMEngine, SamplingParams

POISON = "poison"


@pytest.fixture()
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=128, block_size=4))


def _run(engine: LLMEngine, requests: dict[str, list[int]], params: SamplingParams) -> dict:
    for rid, ids in requests.items():
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


PROMPTS = {"a": [10, 11, 12, 13], POISON: [20, 21, 22], "b": [30, 31, 32, 33, 34]}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_a_sampler_fault_fails_only_the_faulty_request(engine):
    reference = _run(engine, {k: v for k, v in PROMPTS.items() if k != POISON}, GREEDY)
    sampler = engine.executor.sampler
    real_launch = sampler.launch

    def faulty_launch(logits, seqs, *extra):  # injected fault: this request's parameters "crash" the sampler
        if any(s.request_id == POISON for s in seqs):
            raise ValueError("Overflow when unpacking long long")
        return real_launch(logits, seqs, *extra)

    sampler.launch = faulty_launch
    done = _run(engine, PROMPTS, GREEDY)
    assert done[POISON].finish_reason == "error" and "Overflow" in done[POISON].error
    for rid in ("a", "b"):  # batch-mates finish exactly as they would have alone
        assert done[rid].error is None and done[rid].token_ids == reference[rid].token_ids
    stats = engine.stats()
    assert stats.num_running == 0 and stats.kv_usage == 0.0  # the failed request's blocks are free
    assert engine.requests_failed_total == 1
    sampler.launch = real_launch  # and the engine serves on
    assert _run(engine, {"c": [40, 41]}, GREEDY)["c"].error is None


def test_a_fault_while_applying_a_token_fails_only_that_request(engine):
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.add_request(POISON, PROMPTS[POISON], GREEDY)
    engine.step()  # both admitted and prefilled; detokenizers exist now
    detok = engine.scheduler.requests[POISON].detokenizer

    def faulty_add_token(token):  # injected fault in the per-request post-processing
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    detok.add_token = faulty_add_token
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[POISON].finish_reason == "error" and "injected" in done[POISON].error
    assert done["a"].error is None and len(done["a"].token_ids) == GREEDY.max_tokens


def test_top_k_beyond_the_vocabulary_is_refused_up_front(engine):
    from serving.engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="top_k"):
        engine.add_request("x", [1, 2], SamplingParams(top_k=engine.runner.vocab_size + 1))
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=2 ** 64)
