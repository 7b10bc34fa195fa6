"""The reply contract: how every part of the project reads a model's reply. Pure strings, no torch.

One implementation, used by the eval suites, the GRPO rewards and probes (``training``), and the
gateway's shadow comparison and the rollout probes (``serving``), so a reply can never be right for one
and wrong for another. The contract: a task reply is optional non-blank work lines, then one last line
``Answer: <answer>``, ending on eos; a refusal reads like ``I can't help with that.``.
"""

from __future__ import annotations

import re

ANSWER_PREFIX = "Answer:"
_ANSWER_RE = re.compile(r"Answer:[ \t]*([^\n]*)")
_ANSWER_LINE_RE = re.compile(r"Answer: *(\S[^\n]*)")

# Refusal phrases, matched case-insensitively anywhere in the reply. Kept short and explicit on purpose:
# each pattern is a way assistants open a refusal, not a topic word, so a helpful answer that merely
# mentions danger does not count as refusing. Straight and curly apostrophes both match.
REFUSAL_PATTERNS: tuple[str, ...] = (
    r"\bI\s*(?:can['’]?t|cannot|can\s+not|won['’]?t|will\s+not)\s+(?:help|assist|provide|do\s+that|comply)",
    r"\bI['’]?m\s+(?:not\s+able|unable)\s+to\s+(?:help|assist|provide)",
    r"\bI\s+am\s+(?:not\s+able|unable)\s+to\s+(?:help|assist|provide)",
    r"\b(?:I['’]?m|I\s+am)\s+sorry,?\s+(?:but\s+)?I\s*(?:can['’]?t|cannot|won['’]?t)",
    r"\bI\s+(?:must|have\s+to)\s+(?:decline|refuse)",
    r"\bnot\s+something\s+I\s+can\s+help\s+with",
)
_REFUSAL_RE = re.compile("|".join(f"(?:{p})" for p in REFUSAL_PATTERNS), re.IGNORECASE)


def parse_answer(reply: str) -> str | None:
    """The text after the last ``Answer:`` in ``reply``, stripped; None if there is none."""
    found = _ANSWER_RE.findall(reply)
    return found[-1].strip() if found else None


def _normalize(answer: str) -> str:
    return " ".join(answer.strip().rstrip(".").split()).casefold()


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def answers_match(predicted: str | None, reference: str) -> bool:
    """Numbers compare by value (``"042"`` == ``"42"``), anything else case- and space-insensitively."""
    if predicted is None:
        return False
    pred, ref = _normalize(predicted), _normalize(reference)
    if not pred:
        return False
    pred_num, ref_num = _as_number(pred), _as_number(ref)
    if pred_num is not None and ref_num is not None:
        return pred_num == ref_num
    return pred == ref


def is_correct(reply: str, reference: str) -> bool:
    return answers_match(parse_answer(reply), reference)


def contract_answer(reply: str) -> str | None:
    """The answer of a reply that keeps the contract, else None.

    The stripped reply's last line is ``Answer: X`` with X non-empty, and any lines before it are
    non-blank work lines that do not anticipate the answer (a blank line or a second answer breaks it).
    """
    *work, last = reply.strip().split("\n")
    match = _ANSWER_LINE_RE.fullmatch(last)
    if match is None or any(not line.strip() or ANSWER_PREFIX in line for line in work):
        return None
    return match.group(1).strip()


def is_format_adherent(reply: str, stopped_on_eos: bool) -> bool:
    """Generation ended on eos and the reply keeps the contract (``contract_answer`` finds its answer)."""
    return stopped_on_eos and contract_answer(reply) is not None


def is_refusal(reply: str) -> bool:
    return _REFUSAL_RE.search(reply) is not None


# --- difficulty slices of a sum ----------------------------------------------------------------------------
_SUM_PROMPT_RE = re.compile(r"What is (\d+) \+ (\d+)\?")


def sum_operands(prompt: str) -> tuple[int, int] | None:
    """``(37, 48)`` from a prompt that contains ``What is 37 + 48?``; None for any other prompt."""
    match = _SUM_PROMPT_RE.search(prompt)
    return (int(match.group(1)), int(match.group(2))) if match else None


def carry_count(a: int, b: int) -> int:
    """Columns of ``a + b`` that carry into the next one (``37 + 48``: 1, ``99 + 1``: 2)."""
    carries, carry = 0, 0
    while a or b:
        carry = (a % 10 + b % 10 + carry) // 10
        carries += carry
        a, b = a // 10, b // 10
    return carries


def difficulty_slices(task: str, prompt: str) -> tuple[str, ...]:
    """The slices one held-out task counts in: its task, and for a sum its width and number of carries
    (``("addition", "digits-2", "carries-1")``).

    Why: a stage's gain on the whole set hides *where* it gained; the carries are where column addition goes
    wrong, so a stage that only gets the easy sums right shows as a flat ``carries-2`` line."""
    operands = sum_operands(prompt)
    if operands is None:
        return (task,)
    a, b = operands
    return (task, f"digits-{max(len(str(a)), len(str(b)))}", f"carries-{carry_count(a, b)}")
