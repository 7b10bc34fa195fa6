"""Task generators: deterministic, disjoint splits, answers checkable."""

from __future__ import annotations

import pytest

from training.tasks import (
    REFUSAL,
    TASKS,
    TaskExample,
    addition_work,
    answers_match,
    check_answer,
    contract_answer,
    generate_examples,
    generate_safety,
    is_refusal,
    parse_answer,
    safety_pool,
    safety_reply,
    split_of,
)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generation_is_deterministic_and_distinct(task: str) -> None:
    first = generate_examples(task, "train", 200, seed=3)
    assert first == generate_examples(task, "train", 200, seed=3)
    assert first != generate_examples(task, "train", 200, seed=4)
    assert len({ex.prompt for ex in first}) == len(first) == 200
    assert len({ex.id for ex in first}) == 200


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_disjoint_whatever_the_seed(task: str) -> None:
    train = {ex.prompt for seed in range(3) for ex in generate_examples(task, "train", 500, seed)}
    heldout = {ex.prompt for seed in range(3) for ex in generate_examples(task, "heldout", 300, seed)}
    assert train and heldout and not train & heldout


def test_answers_are_right() -> None:
    for ex in generate_examples("addition", "heldout", 50):
        a, b = ex.prompt.removeprefix("What is ").rstrip("?").split(" + ")
        assert int(ex.answer) == int(a) + int(b) and 10 <= int(a) <= 99
    for ex in generate_examples("reverse", "train", 50):
        word = ex.prompt.rsplit(" ", 1)[-1]
        assert ex.answer == word[::-1] and word.isalpha() and word.islower()


def test_column_work_gives_every_sum_and_the_carry_slip_only_when_there_is_a_carry() -> None:
    for a in range(10, 100):
        for b in range(10, 100):
            work, answer = addition_work(a, b)
            units, tens = work.split("\n")
            assert int(answer) == a + b
            assert units.startswith(f"{a % 10}+{b % 10}=") and tens.startswith(f"{a // 10}+{b // 10}+")
            slip_work, slip = addition_work(a, b, carry_slip=True)
            assert (slip != answer) == (a % 10 + b % 10 >= 10)
    ex = generate_examples("addition", "train", 1)[0]
    assert ex.reply == f"{ex.work}\nAnswer: {ex.answer}" and contract_answer(ex.reply) == ex.answer
    word = generate_examples("reverse", "train", 1)[0]
    assert word.reply == f"Answer: {word.answer}" and word.work == ""


def test_split_of_is_stable_and_roughly_balanced() -> None:
    keys = [f"addition:{a}+{b}" for a in range(10, 100) for b in range(10, 100)]
    share = sum(split_of(k) == "heldout" for k in keys) / len(keys)
    assert 0.15 < share < 0.25
    assert split_of("addition:37+48") == split_of("addition:37+48")


def test_asking_for_more_than_exists_fails() -> None:
    with pytest.raises(ValueError, match="only about"):
        generate_examples("addition", "heldout", 5000)
    with pytest.raises(ValueError, match="^task:"):
        generate_examples("division", "train", 1)
    with pytest.raises(ValueError, match="^split:"):
        generate_examples("addition", "test", 1)


def test_check_answer_parses_the_answer_line() -> None:
    ex = TaskExample(id="x", task="addition", prompt="What is 37 + 48?", answer="85")
    assert check_answer(ex, "Answer: 85")
    assert check_answer(ex, "  Answer:85.\n")
    assert check_answer(ex, "Let me think.\nAnswer: 85")
    assert not check_answer(ex, "Answer: 84")
    assert not check_answer(ex, "85")
    assert not check_answer(ex, "Answer: eighty-five")
    word = TaskExample(id="y", task="reverse", prompt="Reverse the word: abc", answer="cba")
    assert check_answer(word, "Answer: cba") and not check_answer(word, "Answer: abc")
    assert parse_answer("no answer here") is None
    assert parse_answer("Answer: 1\nAnswer: 2") == "2"
    assert not answers_match(None, "3")


def test_safety_set_pairs_harmful_with_lookalikes() -> None:
    train, heldout = safety_pool("train"), safety_pool("heldout")
    for split in (train, heldout):
        assert split["harmful"] and split["lookalike"]
        assert all(ex.should_refuse for ex in split["harmful"])
        assert not any(ex.should_refuse for ex in split["lookalike"])
    train_prompts = {ex.prompt for exs in train.values() for ex in exs}
    assert not train_prompts & {ex.prompt for exs in heldout.values() for ex in exs}
    for split in (train, heldout):  # every harmful prompt names its harm category (the safety suite's slice)
        assert {ex.harm for ex in split["harmful"]} == {"explosives", "chemical and radiological", "firearms"}
        assert all(ex.to_dict()["harm"] == ex.harm for ex in split["harmful"])
        assert all(not ex.harm and "harm" not in ex.to_dict() for ex in split["lookalike"])
    sample = generate_safety("heldout", 4, seed=1)
    assert sample == generate_safety("heldout", 4, seed=1)
    assert [ex.category for ex in sample].count("harmful") == 4
    for ex in sample:
        assert is_refusal(safety_reply(ex)) == ex.should_refuse
    assert safety_reply(train["harmful"][0]) == REFUSAL
