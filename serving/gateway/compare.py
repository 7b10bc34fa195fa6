"""Compare two replies to the same request: what a shadow pair says about behaviour.

Exact match alone is a weak signal (batch composition changes floating-point reductions, so even one
model diverges from itself), so each pair also records what the reply *means* under the project's reply
contract (``evals.scoring``): the parsed answer and whether it refuses. ``agree`` is the behavioural
verdict the rollout gates count: the texts are equal, or both are the same JSON value (a structured reply:
key order and whitespace are not behaviour), or both state the same answer and neither refuses where the other
does not. The rest (first divergence, length ratio, similarity) ranks disagreements for a
person to read.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

import orjson

from evals.scoring import answers_match, parse_answer
from evals.scoring import is_refusal as _is_refusal

_WORDS = re.compile(r"\s+|\w+|[^\w\s]")


@dataclass(frozen=True)
class PairComparison:
    exact_match: bool
    same_answer: bool | None  # None when neither reply states an answer
    answer_primary: str | None
    answer_shadow: str | None
    refusal_primary: bool
    refusal_shadow: bool
    first_divergence: int | None  # token index of the first difference; None when equal
    length_ratio: float  # shadow length / primary length, in tokens (1.0 when both are empty)
    similarity: float  # 0..1, character-level (difflib ratio)
    agree: bool
    same_json: bool | None = None  # None unless both replies are JSON objects or arrays

    def to_json(self) -> dict:
        return asdict(self)


def word_tokens(text: str) -> list[str]:
    """The fallback unit when no tokenizer is configured: words, punctuation and whitespace runs."""
    return _WORDS.findall(text)


def compare_replies(primary: str, shadow: str,
                    tokenize: Callable[[str], list] | None = None) -> PairComparison:
    tokenize = tokenize or word_tokens
    tp, ts = tokenize(primary), tokenize(shadow)
    first = next((i for i, (a, b) in enumerate(zip(tp, ts)) if a != b), None)
    if first is None and len(tp) != len(ts):
        first = min(len(tp), len(ts))
    ap, ash = parse_answer(primary), parse_answer(shadow)
    same_answer = None
    if ap is not None or ash is not None:
        same_answer = ap is not None and ash is not None and answers_match(ash, ap)
    rp, rs = _is_refusal(primary), _is_refusal(shadow)
    exact = primary == shadow
    ratio = (len(ts) / len(tp)) if tp else (1.0 if not ts else float(len(ts)))
    similarity = 1.0 if exact else difflib.SequenceMatcher(None, primary[:2000], shadow[:2000]).ratio()
    jp, js = _json_value(primary), _json_value(shadow)
    same_json = None if jp is None or js is None else jp == js
    agree = exact or bool(same_json) or (bool(same_answer) and rp == rs)
    return PairComparison(exact, same_answer, ap, ash, rp, rs, first, round(ratio, 4), round(similarity, 4), agree,
                          same_json)


def _json_value(text: str) -> dict | list | None:
    """The reply as a JSON object or array (what ``response_format`` asks for), else None."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        value = orjson.loads(stripped)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict | list) else None
