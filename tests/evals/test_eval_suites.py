"""Suites on the real micro model: perplexity, preference accuracy and sampled task accuracy."""

from __future__ import annotations

import math
import random
import string

import pytest
from eval_testutil import read_jsonl, write_jsonl

from evals.config import EvalConfig
from evals.context import EvalContext
from evals.suites import perplexity, preference, sampled_task_accuracy, task_accuracy
from evals.suites.perplexity import windows
from evals.suites.sampled_task_accuracy import score_samples


def _garbage(rng: random.Random, n_chars: int) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits + "#%&") for _ in range(n_chars))


def _context(lm, data_dir, **kwargs) -> EvalContext:
    return EvalContext(lm=lm, data_dir=data_dir, config=EvalConfig(**{"batch_size": 8, **kwargs}))


@pytest.mark.parametrize("length, max_len", [(1, 8), (2, 8), (8, 8), (9, 8), (30, 8), (31, 7), (50, 2)])
def test_windows_score_every_token_once_within_the_context(length, max_len):
    ids = list(range(100, 100 + length))
    pieces = windows(ids, max_len)
    scored = [t for _, s in pieces for t in s]
    assert scored == ids[1:]  # every token but the first, once, in order
    for context, scored_part in pieces:
        assert 1 <= len(context) and len(context) + len(scored_part) <= max_len
        start = ids.index(scored_part[0])
        assert context == ids[start - len(context):start]  # the context is what immediately precedes


def test_perplexity_lower_on_training_like_text_than_on_random_text(micro_lm, micro_data_dir, tmp_path):
    training_like = read_jsonl(micro_data_dir / "calibration.jsonl")  # the training distribution
    rng = random.Random(0)
    random_text = [{"text": _garbage(rng, len(r["text"]))} for r in training_like]
    write_jsonl(tmp_path / "train_like" / "text_heldout.jsonl", training_like)
    write_jsonl(tmp_path / "random" / "text_heldout.jsonl", random_text)
    (low,) = perplexity.run(_context(micro_lm, tmp_path / "train_like"))
    (high,) = perplexity.run(_context(micro_lm, tmp_path / "random"))
    assert math.isfinite(low.value) and math.isfinite(high.value)
    assert 1.0 < low.value < high.value
    expected_tokens = sum(len(micro_lm.tokenizer(r["text"])["input_ids"]) - 1 for r in training_like)
    assert low.n == expected_tokens  # token-weighted: n counts predicted tokens


def test_perplexity_of_text_longer_than_the_context(micro_lm, micro_data_dir, tmp_path):
    texts = [r["text"] for r in read_jsonl(micro_data_dir / "text_heldout.jsonl")]
    long_text = " ".join(texts)
    n_tokens = len(micro_lm.tokenizer(long_text)["input_ids"])
    assert n_tokens > micro_lm.max_context
    write_jsonl(tmp_path / "long" / "text_heldout.jsonl", [{"text": long_text, "source": "joined"}])
    (result,) = perplexity.run(_context(micro_lm, tmp_path / "long"))
    assert math.isfinite(result.value) and result.n == n_tokens - 1
    assert result.slices["joined"].n == result.n


def test_preference_accuracy_separates_trained_text_from_garbage(micro_lm, micro_data_dir, tmp_path):
    rng = random.Random(1)
    pairs = []
    for record in read_jsonl(micro_data_dir / "sft_train.jsonl")[::8]:  # conversations it was trained on
        user, reply = record["messages"][0], record["messages"][-1]
        garbage = {"role": "assistant", "content": _garbage(rng, len(reply["content"]))}
        pairs.append({"prompt": [user], "chosen": [reply], "rejected": [garbage],
                      "task": "refusal" if "help" in reply["content"] else "task"})
    write_jsonl(tmp_path / "right" / "pref_heldout.jsonl", pairs)
    swapped = [dict(p, chosen=p["rejected"], rejected=p["chosen"]) for p in pairs]
    write_jsonl(tmp_path / "swapped" / "pref_heldout.jsonl", swapped)
    (right,) = preference.run(_context(micro_lm, tmp_path / "right"))
    (wrong,) = preference.run(_context(micro_lm, tmp_path / "swapped"))
    assert right.n == wrong.n == len(pairs)
    assert right.value == 1.0 and wrong.value == 0.0
    assert sum(s.n for s in right.slices.values()) == len(pairs)


def test_preference_scores_the_templated_reply_turn(micro_lm):
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = [{"role": "assistant", "content": "Answer: 5"}]
    prompt_ids, reply_ids = preference.reply_item(micro_lm, prompt, reply)
    assert prompt_ids + reply_ids == micro_lm.encode(micro_lm.chat_text(prompt + reply))
    assert micro_lm.tokenizer.decode(reply_ids) == "Answer: 5<|end|>\n"  # end-of-turn is scored too


def test_preference_on_the_data_stage_file(micro_lm, micro_data_dir):
    (result,) = preference.run(_context(micro_lm, micro_data_dir, max_examples=6))
    assert result.n == 6 and 0.0 <= result.value <= 1.0


def test_likelihood_batches_respect_the_logits_budget(monkeypatch, micro_lm):
    from evals import logprobs

    order, lengths = [0, 1, 2, 3, 4], [10, 9, 9, 5, 1]
    assert logprobs._plan_batches(order, lengths, 4, vocab=100) == [[0, 1, 2, 3], [4]]
    monkeypatch.setattr(logprobs, "LOGITS_BUDGET", 2 * 10 * 100)  # two rows of the widest fit
    assert logprobs._plan_batches(order, lengths, 4, vocab=100) == [[0, 1], [2, 3], [4]]
    monkeypatch.setattr(logprobs, "LOGITS_BUDGET", 1)  # always at least one row per batch
    assert logprobs._plan_batches(order, lengths, 4, vocab=100) == [[0], [1], [2], [3], [4]]
    items = [([1, 2], [3, 4, 5]), ([7], [8]), ([1, 2], [3, 4, 5])]
    small = logprobs.completion_logprobs(micro_lm, items, batch_size=8)
    assert small[0] == pytest.approx(small[2]) and all(v < 0 for v in small)


def test_sampled_accuracy_is_the_mean_over_draws_and_pass_at_k_any_right():
    records = [{"task": "addition", "prompt": "What is 2 + 3?", "answer": "5"},
               {"task": "addition", "prompt": "What is 3 + 4?", "answer": "7"},
               {"task": "reverse", "prompt": "Reverse the word: abc", "answer": "cba"}]
    samples = [["Answer: 5", "Answer: 5", "Answer: 6", "Answer: 5"],  # 3 of 4
               ["Answer: 1", "Answer: 2", "Answer: 3", "nothing"],  # none
               ["Answer: cba", "Answer: abc", "Answer: abc", "Answer: abc"]]  # 1 of 4
    sampled, any_right = score_samples(records, samples)
    assert sampled.metric == "sampled_task_accuracy" and any_right.metric == "task_pass_at_k"
    assert sampled.value == pytest.approx((0.75 + 0.0 + 0.25) / 3) and sampled.n == 3
    assert any_right.value == pytest.approx(2 / 3)
    assert sampled.slices["addition"].value == pytest.approx(0.375) and sampled.slices["reverse"].n == 1
    assert sampled.slices["digits-1"].n == 2 and any_right.slices["carries-0"].value == pytest.approx(0.5)


def test_sampled_suite_draws_k_replies_per_prompt_and_tends_to_greedy_when_cold(micro_lm, micro_data_dir):
    hot = _context(micro_lm, micro_data_dir, max_new_tokens=24, samples_per_prompt=3, sample_temperature=1.0)
    records = read_jsonl(micro_data_dir / "tasks_heldout.jsonl")
    prompts = [hot.user_prompt(r["prompt"]) for r in records]
    sampled, any_right = sampled_task_accuracy.run(hot)
    assert sampled.n == any_right.n == len(records)
    assert all(len(draws) == 3 for draws in hot.sample(prompts, desc="again"))  # cached: the same draws
    assert 0.0 <= sampled.value <= any_right.value <= 1.0
    cold = _context(micro_lm, micro_data_dir, max_new_tokens=24, samples_per_prompt=2, sample_temperature=1e-4)
    cold_sampled, cold_any = sampled_task_accuracy.run(cold)
    (greedy,) = task_accuracy.run(cold)
    assert cold_sampled.value == cold_any.value == greedy.value  # argmax draws are the greedy replies
