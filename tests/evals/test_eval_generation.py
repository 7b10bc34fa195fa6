"""Batched generation: left padding must not change any reply; stop reasons are reported; sampling is seeded."""

from __future__ import annotations

import pytest
import torch
from eval_testutil import read_jsonl

from evals.errors import EvalError
from evals.generation import generate_replies


@pytest.fixture(scope="module")
def prompts(micro_lm, micro_data_dir):
    records = read_jsonl(micro_data_dir / "tasks_heldout.jsonl")[:6]
    records += read_jsonl(micro_data_dir / "safety_heldout.jsonl")[:2]
    return [micro_lm.chat_prompt([{"role": "user", "content": r["prompt"]}]) for r in records]


def test_batched_equals_one_at_a_time(micro_lm, prompts):
    assert len({len(micro_lm.encode(p)) for p in prompts}) > 1  # lengths differ: padding is exercised
    batched = generate_replies(micro_lm, prompts, max_new_tokens=12, batch_size=8)
    single = generate_replies(micro_lm, prompts, max_new_tokens=12, batch_size=1)
    assert batched == single
    again = generate_replies(micro_lm, [prompts[3], prompts[0]], max_new_tokens=12, batch_size=3)
    assert again == [single[3], single[0]]  # results come back in the caller's order


def test_stop_reason_and_token_limit(micro_lm, prompts):
    for max_new in (1, 3):
        for gen in generate_replies(micro_lm, prompts, max_new_tokens=max_new, batch_size=4):
            assert gen.n_tokens <= max_new
            if not gen.stopped_on_eos:
                assert gen.n_tokens == max_new
    end_texts = [micro_lm.tokenizer.convert_ids_to_tokens(i) for i in micro_lm.eos_ids]
    for gen in generate_replies(micro_lm, prompts, max_new_tokens=24, batch_size=4):
        assert not any(t in gen.raw for t in end_texts)  # the stop token is not part of the reply


def test_over_long_prompt_keeps_its_end(micro_lm):
    long_prompt = micro_lm.chat_prompt([{"role": "user", "content": "abc " * 400}])
    assert len(micro_lm.encode(long_prompt)) > micro_lm.max_context
    (gen,) = generate_replies(micro_lm, [long_prompt], max_new_tokens=4, batch_size=1)
    assert gen.n_tokens <= 4
    with pytest.raises(EvalError, match="max_new_tokens"):
        generate_replies(micro_lm, ["x"], max_new_tokens=micro_lm.max_context, batch_size=1)


def test_sampling_is_seeded_and_leaves_the_callers_random_state_alone(micro_lm, prompts):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = generate_replies(micro_lm, prompts * 3, max_new_tokens=12, batch_size=8, temperature=1.0, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's generator did not move
    again = generate_replies(micro_lm, prompts * 3, max_new_tokens=12, batch_size=8, temperature=1.0, seed=7)
    other = generate_replies(micro_lm, prompts * 3, max_new_tokens=12, batch_size=8, temperature=1.0, seed=8)
    assert first == again and first != other
    greedy = generate_replies(micro_lm, prompts, max_new_tokens=12, batch_size=8)
    assert [g.text for g in first] != [g.text for g in greedy] * 3  # it samples: not the greedy replies
    assert len({g.text for g in first[::len(prompts)]}) > 1  # one prompt, three different draws


def test_near_zero_temperature_samples_the_greedy_replies(micro_lm, prompts):
    greedy = generate_replies(micro_lm, prompts, max_new_tokens=12, batch_size=8)
    cold = generate_replies(micro_lm, prompts, max_new_tokens=12, batch_size=8, temperature=1e-4, seed=3)
    assert cold == greedy
    with pytest.raises(EvalError, match="temperature"):
        generate_replies(micro_lm, prompts, max_new_tokens=4, batch_size=8, temperature=-1.0)
