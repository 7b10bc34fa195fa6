"""n-gram speculative decoding: the greedy output token for token, fewer steps when the context repeats,
the stop rules unchanged, its counters on /metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.engine import EngineConfig, LLMEngine, SamplingParams
from serving.engine.speculative import GuessBudget, NgramProposer, accepted_prefix, expected_yield, next_lookahead
from tests.serving.test_api_server import MODEL, running_server

PROMPTS = [
    "Repeat this list: apple, pear, plum, fig, apple, pear, plum, fig, apple, pear,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Grüße aus München — ça va?",  # little to look up: speculation must not change it either
    "Hello world! Answer: 42.",
]


def test_proposer_continues_the_latest_longest_match():
    proposer = NgramProposer(k=3, max_n=3, min_n=2)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], limit=10) == [7, 8, 5]  # latest occurrence
    assert proposer.propose([5, 6, 1, 2, 4, 4, 6, 1, 2], limit=10) == [4, 4, 6]  # 3-gram "6 1 2" beats "1 2"
    assert proposer.propose([1, 2, 3, 1, 2], limit=1) == [3]  # never past the request's room
    assert proposer.propose([1, 2, 3, 4], limit=5) == []  # nothing repeats: no guess
    assert proposer.propose([7, 7], limit=5) == []  # the suffix itself is not an earlier occurrence
    with pytest.raises(ValueError, match="speculation"):
        NgramProposer(k=0)


def test_lookahead_grows_while_guesses_are_kept_and_shrinks_on_a_rejection():
    k = 4
    assert next_lookahead(1, drafted=1, kept=1, k=k) == 3
    assert next_lookahead(3, drafted=3, kept=3, k=k) == k  # capped at k
    assert next_lookahead(k, drafted=k, kept=2, k=k) == 3
    assert next_lookahead(1, drafted=1, kept=0, k=k) == 1  # never below one guess


def test_guesses_are_worth_asking_for_while_their_chance_beats_a_pass_cost():
    budget = GuessBudget()
    assert budget.worth(0.5, k=4) == 4  # no cost measured yet: every guess
    budget.record_cost(pass_seconds=5.0, target_seconds=1.0)  # the first step: warming up, not counted
    assert budget.cost_ratio is None
    budget.record_cost(pass_seconds=0.3, target_seconds=1.0)
    assert budget.cost_ratio == pytest.approx(0.3)
    assert budget.worth(0.8, k=4) == 4  # 0.8 ** 4 = 0.41 >= 0.3
    assert budget.worth(0.6, k=4) == 2  # 0.36 >= 0.3 > 0.216
    assert budget.worth(0.25, k=4) == 0
    budget.record_cost(pass_seconds=1.3, target_seconds=1.0)  # decayed toward the new ratio
    assert budget.cost_ratio == pytest.approx(0.8 * 0.3 + 0.2 * 1.3)
    assert budget.acceptance() == 1.0  # nothing checked yet: optimistic
    budget.record_guesses(drafted=4, kept=1)  # 1 kept, then 1 rejected: 2 checked
    assert budget.acceptance() == pytest.approx(0.5)
    assert budget.acceptance(kept=10, checked=10) == pytest.approx((10 + 2 * 0.5) / 12)  # a request's own record
    assert expected_yield(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)


def test_accepted_prefix_keeps_agreeing_guesses_then_the_models_token():
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accepted_prefix([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted_prefix([4, 5, 6], [1, 5, 6, 7]) == [1]


def _engine(model_dir, speculative_tokens: int, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, EngineConfig(num_blocks=256, block_size=8,
                                                             speculative_tokens=speculative_tokens, **kw))


@pytest.fixture(scope="module")
def engines(micro_base_dir):
    """The embedded micro model, pretrained for real: like small models do, it falls into loops that an
    n-gram lookup can follow (the random-init serving fixture never repeats itself)."""
    return _engine(micro_base_dir, 0), _engine(micro_base_dir, 4)


def test_greedy_output_is_identical_with_fewer_steps(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for prompt in PROMPTS:  # one at a time: batch 1, where speculation pays
        steps_before = (plain.num_steps, spec.num_steps)
        (a,), (b,) = plain.generate([prompt], params), spec.generate([prompt], params)
        assert b.token_ids == a.token_ids and b.text == a.text, prompt
        assert len(b.token_ids) == 48
    assert spec.speculation.accepted > 0
    assert spec.num_steps - steps_before[1] <= plain.num_steps - steps_before[0]
    together_plain = plain.generate(PROMPTS, params)  # and batched with each other
    together_spec = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in together_spec] == [o.token_ids for o in together_plain]


@pytest.mark.parametrize("model_impl", ["compact", "hf"])
def test_fewer_engine_steps_when_the_reply_repeats_its_context(micro_base_dir, model_impl):
    plain, spec = (_engine(micro_base_dir, k, model_impl=model_impl) for k in (0, 4))
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    (a,), (b,) = plain.generate([PROMPTS[0]], params), spec.generate([PROMPTS[0]], params)
    assert b.token_ids == a.token_ids
    stats = spec.stats()
    assert stats.spec_draft_tokens_total > 0 and 0 < stats.spec_acceptance_rate <= 1
    assert spec.num_steps * 2 < plain.num_steps  # tokens came several a step


def test_stop_rules_apply_inside_an_accepted_guess(engines):
    assert_stop_rules_match(*engines)


def assert_stop_rules_match(plain: LLMEngine, spec: LLMEngine) -> None:
    """Length, stop string, stop id and min_tokens end a speculating request exactly where they end a plain one
    (the rule may land inside a run of accepted guesses). Shared with the draft-model tests."""
    (reference,) = plain.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stop_text = reference.text[len(reference.text) // 2:][:3]
    cases = [SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),  # length lands mid-guess
             SamplingParams(temperature=0, max_tokens=40, stop=[stop_text]),  # stop string
             SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[reference.token_ids[9]]),
             SamplingParams(temperature=0, max_tokens=40, min_tokens=5)]
    for params in cases:
        (a,), (b,) = plain.generate([PROMPTS[0]], params), spec.generate([PROMPTS[0]], params)
        assert (b.token_ids, b.text, b.finish_reason, b.outputs[0].stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.outputs[0].stop_reason), params


def test_requests_that_cannot_speculate_share_the_batch(engines):
    """Sampled, penalised and logprob requests decode one token a step beside speculating ones."""
    _, spec = engines
    drafted = spec.speculation.drafted
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=2, max_tokens=32, ignore_eos=True)]
    outs = spec.generate([PROMPTS[0]] * 4, params)
    assert all(len(o.token_ids) == 32 for o in outs)
    assert len(outs[3].outputs[0].logprobs) == 32
    assert spec.speculation.drafted > drafted


def test_metrics_report_the_acceptance_over_http(micro_base_dir):
    cfg = EngineConfig(num_blocks=128, block_size=8, max_num_seqs=4, speculative_tokens=4)
    with running_server(micro_base_dir, cfg) as (base, _):
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 48,
                                                        "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
                   for s in f.samples}
    assert samples["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] > 0
    rate = samples["vllm:spec_decode_draft_acceptance_rate"]
    assert rate == pytest.approx(samples["vllm:spec_decode_num_accepted_tokens_total"]
                                 / samples["vllm:spec_decode_num_draft_tokens_total"])
    assert samples["vllm:spec_decode_draft_cost_ratio"] == 0  # no draft model: no pass to weigh
