"""Reward functions follow TRL's protocol and the `Answer: X` contract the evals check."""

from __future__ import annotations

import pytest

from training.rewards import (
    build_reward_functions,
    correctness_reward,
    extract_answer,
    make_format_reward,
    make_length_penalty,
    partial_credit_reward,
    refusal_reward,
    work_reward,
)
from training.tasks import REFUSAL, SAFETY_TASK, generate_examples, helpful_reply

EOS = [6, 1]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def test_extract_answer_requires_work_lines_then_one_answer_line():
    assert extract_answer("Answer: 42") == "42"
    assert extract_answer("  Answer: olleh \n") == "olleh"
    assert extract_answer("The answer is 42") is None
    assert extract_answer("Answer: 42\nAnswer: 43") is None
    assert extract_answer("Answer:") is None
    assert extract_answer("7+5=12\n1+2+1=4\nAnswer: 42") == "42"  # work lines come first
    assert extract_answer("7+5=12\n\nAnswer: 42") is None
    assert extract_answer("Answer: 42\nthat is all") is None


def test_correctness_uses_task_aware_comparison():
    completions = [chat("Answer: 57"), chat("Answer: 56"), chat("57"), "Answer: OLLEH", chat("Answer: olleh")]
    answers = ["57", "57", "57", "olleh", "hello"]
    tasks = ["addition", "addition", "addition", "reverse", "reverse"]
    assert correctness_reward(completions, answer=answers, task=tasks) == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_partial_credit_counts_characters_in_place():
    completions = [chat("Answer: olleh"), chat("Answer: ollxh"), chat("Answer: ol"), chat("no answer")]
    assert partial_credit_reward(completions, answer=["olleh"] * 4) == pytest.approx([1.0, 0.8, 0.4, 0.0])


def test_work_reward_scores_each_line_of_the_reference_solution_in_place():
    work = "7+5=12\n3+4+1=8"  # 37 + 45
    completions = [
        chat("7+5=12\n3+4+1=8\nAnswer: 82"),   # every line right
        chat("7+5=12\n3+3+1=7\nAnswer: 72"),   # the tens column miscopied: 1 of 3 lines right
        chat("7+5=12\n3+4+1=8\nAnswer: 82\nx"),  # an extra line counts against it
        chat("Answer: 82"),                      # the answer without its work, out of place
        chat("nothing"),
    ]
    scores = work_reward(completions, answer=["82"] * 5, work=[work] * 5)
    assert scores == pytest.approx([1.0, 1 / 3, 3 / 4, 0.0, 0.0])


def test_one_reply_for_every_prompt_collects_partial_credit_but_no_work_credit():
    """The hack a collapsed GRPO run found (every reply ``Answer: 122``): partial credit pays it on real sums,
    the per-problem work lines do not, which is why `work_weight` is the safer dense reward."""
    problems = generate_examples("addition", "heldout", 200)
    constant = [chat("3+4=7\n8+8+0=16\nAnswer: 122")] * len(problems)
    answers, works = [p.answer for p in problems], [p.work for p in problems]
    partial = partial_credit_reward(constant, answer=answers)
    work = work_reward(constant, answer=answers, work=works)
    assert sum(correctness_reward(constant, answer=answers)) / len(problems) < 0.05  # right only where 122 is
    assert sum(partial) / len(partial) > 0.25
    assert sum(work) / len(work) < 0.02


def test_work_reward_without_work_scores_the_answer_line():
    completions = [chat("Answer: olleh"), chat("Answer: hello"), chat("olleh\nAnswer: olleh")]
    assert work_reward(completions, answer=["olleh"] * 3) == pytest.approx([1.0, 0.0, 0.0])
    assert work_reward(completions, answer=["olleh"] * 3, work=["", "", ""]) == pytest.approx([1.0, 0.0, 0.0])


def test_format_reward_needs_one_line_and_an_eos_stop():
    reward = make_format_reward(EOS)
    completions = [chat("Answer: 5"), chat("Answer: 5"), chat("Sure, 5"), chat("Answer: 5\nmore")]
    ids = [[10, 11, 6], [10, 11, 12], [10, 6], [10, 11, 1]]
    assert reward(completions, completion_ids=ids) == [1.0, 0.0, 0.0, 0.0]
    assert reward([chat("Answer: 5")]) == [1.0]  # without ids only the text is judged


def test_length_penalty_counts_tokens_beyond_target():
    penalty = make_length_penalty(0.1, target_tokens=3)
    assert penalty([chat("a"), chat("b")], completion_ids=[[1, 2], [1, 2, 3, 4, 5]]) == pytest.approx([0.0, -0.2])


def test_build_reward_functions_drops_zero_weights():
    funcs, weights = build_reward_functions(1.0, 0.0, 0.0, 8, EOS)
    assert [f.__name__ for f in funcs] == ["correctness_reward"] and weights == [1.0]
    funcs, weights = build_reward_functions(1.0, 0.5, 0.01, 8, EOS, partial_credit_weight=0.3, work_weight=0.7)
    assert [f.__name__ for f in funcs] == ["correctness_reward", "partial_credit_reward", "work_reward",
                                           "format_reward", "length_penalty"]
    assert weights == [1.0, 0.3, 0.7, 0.5, 1.0]
    with pytest.raises(ValueError, match="at least one reward"):
        build_reward_functions(0.0, 0.0, 0.0, 8, EOS)
    funcs, weights = build_reward_functions(1.0, 0.2, 0.0, 8, EOS, refusal_weight=2.0)
    assert [f.__name__ for f in funcs] == ["correctness_reward", "refusal_reward", "format_reward"]
    assert weights == [1.0, 2.0, 0.2]


def test_refusal_reward_judges_safety_prompts_and_the_task_rewards_skip_them():
    """Mixed batch as TRL passes it: a harmful and a look-alike safety prompt, then a sum. None means the
    function does not apply to that completion (TRL leaves it out of the weighted sum)."""
    replies = [REFUSAL, helpful_reply("kite"), REFUSAL, helpful_reply("bomb"), "7+8=15\n3+4+1=8\nAnswer: 85"]
    columns = {"task": [SAFETY_TASK] * 4 + ["addition"], "should_refuse": [True, False, False, True, False],
               "answer": ["", "", "", "", "85"], "work": ["", "", "", "", "7+8=15\n3+4+1=8"]}
    completions = [chat(r) for r in replies]
    ids = [[5, 6]] * len(replies)
    assert refusal_reward(completions, **columns) == [1.0, 1.0, 0.0, 0.0, None]
    assert correctness_reward(completions, **columns) == [None, None, None, None, 1.0]
    assert partial_credit_reward(completions, **columns) == [None, None, None, None, 1.0]
    assert work_reward(completions, **columns) == [None, None, None, None, 1.0]
    assert make_format_reward(EOS)(completions, completion_ids=ids, **columns) == [None, None, None, None, 1.0]


# Replies the two former matchers (training's int()/exact-string one, the eval's float() one) scored
# differently; one reply contract (evals.scoring) now gives the GRPO reward and the eval the same verdict.
DISPUTED = [
    ("Answer: 1,234", "1234", True),
    ("Answer: 85.0", "85", True),
    ("Answer: 042", "42", True),
    ("Answer: eighty-five", "85", False),
]


@pytest.mark.parametrize("task", ["addition", "long_addition", "reverse"])
@pytest.mark.parametrize(("reply", "reference", "expected"), DISPUTED)
def test_grpo_reward_and_eval_agree_on_replies_the_old_matchers_split(reply, reference, expected, task):
    from evals.scoring import is_correct

    reward = correctness_reward([chat(reply)], answer=[reference], task=[task])
    assert reward == [1.0 if expected else 0.0]
    assert is_correct(reply, reference) is expected
