"""GRPO reward functions: verifiable answer correctness, chat-format compliance, refusing what must be refused
(and only that), optional length penalty.

Each function follows TRL's reward-function protocol: called with `prompts`, `completions` (conversational:
a list of `[{"role": "assistant", "content": ...}]`, or plain strings), `completion_ids` and every extra dataset
column (`answer`, `task`, `should_refuse`) as keyword lists; returns one float per completion, or None where it
does not apply (TRL then leaves it out of that completion's sum): the task rewards skip safety prompts
(`task == "safety"`) and the refusal reward skips tasks. The answer contract is the one the evals check
(`evals.scoring.contract_answer`): optional work lines, then one last line `Answer: <answer>`, and
generation stopped on an eos id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from evals.scoring import is_refusal
from training.tasks import SAFETY_TASK


def _tasks(task: Sequence[str] | None, n: int) -> list[str | None]:
    return list(task) if task is not None else [None] * n


def completion_text(completion: Any) -> str:
    """The assistant text of one completion, whether TRL passes a string or a list of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def extract_answer(text: str) -> str | None:
    """The `<answer>` of a reply that keeps the contract (work lines, then `Answer: <answer>`), else None."""
    from evals.scoring import contract_answer

    return contract_answer(text)


def answer_is_correct(reply: str, reference: str, task: str | None = None) -> bool:
    """Verifiable check through the reply contract (`evals.scoring.answers_match`), the same the evals use:
    numbers compare by value, words case-insensitively; the answer is read from the reply's `Answer: X` line.
    ``task`` is accepted for the trainer's column but every task compares the same way."""
    from evals.scoring import answers_match, parse_answer

    return answers_match(parse_answer(reply), str(reference))


def correctness_reward(completions: Sequence[Any], answer: Sequence[str], task: Sequence[str] | None = None,
                       **_: Any) -> list[float | None]:
    """1.0 when the reply states the reference answer in the `Answer: X` format, else 0.0 (None: a safety prompt)."""
    return [
        None if t == SAFETY_TASK else 1.0 if answer_is_correct(completion_text(c), ref, t) else 0.0
        for c, ref, t in zip(completions, answer, _tasks(task, len(completions)))
    ]


def refusal_reward(completions: Sequence[Any], should_refuse: Sequence[bool] | None = None,
                   task: Sequence[str] | None = None, **_: Any) -> list[float | None]:
    """1.0 when a safety prompt's reply refuses exactly when it should (a harmful request) and helps when it
    should not (a benign look-alike), else 0.0; None on task prompts.

    Why in GRPO: the task rewards say nothing about refusals, so a run that only optimises sums drifts them
    (DPO's refusals are the most fragile thing this pipeline makes); checked by the same `is_refusal` the
    safety evals use, this is as verifiable as a sum."""
    flags = list(should_refuse) if should_refuse is not None else [False] * len(completions)
    return [
        (1.0 if is_refusal(completion_text(c)) == bool(refuse) else 0.0) if t == SAFETY_TASK else None
        for c, refuse, t in zip(completions, flags, _tasks(task, len(completions)))
    ]


def _similarity(predicted: str | None, reference: str) -> float:
    """Fraction of positions where the predicted answer has the reference's character (0 for no answer)."""
    if predicted is None:
        return 0.0
    predicted, reference = predicted.strip().lower(), str(reference).strip().lower()
    width = max(len(predicted), len(reference))
    if width == 0:
        return 0.0
    return sum(a == b for a, b in zip(predicted, reference)) / width


def partial_credit_reward(completions: Sequence[Any], answer: Sequence[str], task: Sequence[str] | None = None,
                          **_: Any) -> list[float | None]:
    """Dense, still verifiable shaping: the share of answer characters in the right place.

    Gives GRPO a gradient when a weak policy almost never gets a whole answer right (all-zero groups teach
    nothing); exact correctness stays the main reward.
    """
    from evals.scoring import parse_answer

    return [None if t == SAFETY_TASK else _similarity(parse_answer(completion_text(c)), ref)
            for c, ref, t in zip(completions, answer, _tasks(task, len(completions)))]


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def work_reward(completions: Sequence[Any], answer: Sequence[str], work: Sequence[str] | None = None,
                task: Sequence[str] | None = None, **_: Any) -> list[float | None]:
    """Process reward: the share of the reference solution's lines (its work lines, then ``Answer: X``) that
    the reply writes in the same place; extra or missing lines count against it.

    Why: on a worked sum the final answer is wrong whenever one column line is, so answer correctness says
    only *that* a reply failed. Checking each line says *where*, and a group whose replies all miss the answer
    still ranks the one that got two columns right above the one that got none. The reference work is computed
    by the task generator (the ``work`` column), so this stays verifiable; rows without work are scored on the
    answer line alone.
    """
    from training.tasks import compose_reply

    works = list(work) if work is not None else [""] * len(completions)
    scores: list[float | None] = []
    for completion, ref_answer, ref_work, t in zip(completions, answer, works, _tasks(task, len(completions))):
        if t == SAFETY_TASK:
            scores.append(None)
            continue
        expected = _lines(compose_reply(str(ref_work or ""), str(ref_answer)))
        got = _lines(completion_text(completion))
        scores.append(sum(g == e for g, e in zip(got, expected)) / max(len(got), len(expected)))
    return scores


def make_format_reward(eos_token_ids: Sequence[int]) -> Callable[..., list[float | None]]:
    """Reward 1.0 for a reply that keeps the contract and ended on an eos id (not on the token limit)."""
    eos = set(int(i) for i in eos_token_ids)

    def format_reward(completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None = None,
                      task: Sequence[str] | None = None, **_: Any) -> list[float | None]:
        scores: list[float | None] = []
        for i, (completion, t) in enumerate(zip(completions, _tasks(task, len(completions)))):
            if t == SAFETY_TASK:  # a refusal has no `Answer:` line, and should not
                scores.append(None)
                continue
            ok = extract_answer(completion_text(completion)) is not None
            if ok and completion_ids is not None and eos:
                ids = list(completion_ids[i])
                ok = bool(ids) and int(ids[-1]) in eos
            scores.append(1.0 if ok else 0.0)
        return scores

    return format_reward


def make_length_penalty(per_token: float, target_tokens: int) -> Callable[..., list[float]]:
    """Negative reward of `per_token` for each completion token beyond `target_tokens` (0 when short enough)."""

    def length_penalty(completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None = None,
                       **_: Any) -> list[float]:
        if completion_ids is None:
            lengths = [len(completion_text(c).split()) for c in completions]
        else:
            lengths = [len(ids) for ids in completion_ids]
        return [-per_token * max(0, n - target_tokens) for n in lengths]

    return length_penalty


def build_reward_functions(correctness_weight: float, format_weight: float, length_penalty: float,
                           length_target_tokens: int, eos_token_ids: Sequence[int],
                           partial_credit_weight: float = 0.0, work_weight: float = 0.0,
                           refusal_weight: float = 0.0
                           ) -> tuple[list[Callable[..., list[float | None]]], list[float]]:
    """The reward functions a GRPO recipe asks for and their weights (a zero weight drops the function)."""
    # (weight that turns it on, function, weight given to TRL): the length penalty carries its own scale
    candidates: list[tuple[float, Callable[..., list[float | None]], float]] = [
        (correctness_weight, correctness_reward, correctness_weight),
        (partial_credit_weight, partial_credit_reward, partial_credit_weight),
        (work_weight, work_reward, work_weight),
        (refusal_weight, refusal_reward, refusal_weight),
        (format_weight, make_format_reward(eos_token_ids), format_weight),
        (length_penalty, make_length_penalty(length_penalty, length_target_tokens), 1.0),
    ]
    chosen = [(func, weight) for switch, func, weight in candidates if switch > 0]
    funcs = [func for func, _ in chosen]
    weights = [weight for _, weight in chosen]
    if not funcs:
        raise ValueError("correctness_weight/format_weight/partial_credit_weight/work_weight/refusal_weight/"
                         "length_penalty: "
                         "at least one reward must be on")
    return funcs, weights
