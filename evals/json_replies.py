"""The JSON reply contract: a held-out task asked for a JSON answer, and how such a reply is scored. Pure, no torch.

One implementation for the ``structured`` eval suite (``evals.suites.structured``), the rollout's structured
probes (``serving.rollout.probes``) and the SFT chats that teach the format (``training.data``), as
``evals.scoring`` is for plain replies: a reply cannot be valid for one and invalid for another.

The task is the held-out task itself. Where the reference answer is an integer (a sum), the reply is
``{"work":["7+8=15","3+4+1=8"],"answer":85}``: the worked lines first, as strings, then the answer. Reasoning
fields ahead of the answer are the usual way to ask a model that thinks in steps for a structured answer: forced
to write ``{"answer":`` at once, a model that finds a sum in its work lines has nothing to find it with. (The
embedded model still scores 0.000 here: it never saw JSON, and teaching it, ``data.sft_json_per_task``, taught the
format but not the sums in it, at a cost to the plain task; benchmarks/RESULTS.md, "JSON in SFT".) Elsewhere the
reply is ``{"answer":"..."}``.

The bounds keep a grammar from letting a model write digits or letters until ``max_tokens`` cuts the reply (a cut
reply is no answer), and they size every structured reply's room (``reply_token_bound``), which must fit with the
rollout's tool listing in the embedded model's 256-token context: a work line is at most 8 of ``0-9+=`` (a column
is ``9+9+1=19``), there are at most as many lines as the answer has digits (a sum has a column per digit, but for
its carry), the integer has at most one digit more than the reference, and a string may be twice the reference's
length (at least 16 characters).
"""

from __future__ import annotations

import json
import re
from typing import Any

from evals.scoring import answers_match

ANSWER_TOOL = "submit_answer"  # the function a structured tool-call probe must call
_INTEGER_RE = re.compile(r"-?\d+")
_WORK_LINE_CHARS = 8  # a column: 9+9+1=19
WORK_LINE_PATTERN = rf"^[0-9+=]{{1,{_WORK_LINE_CHARS}}}$"


def _is_integer(reference: str) -> bool:
    return _INTEGER_RE.fullmatch(reference.strip()) is not None


def _digits(reference: str) -> int:
    return len(reference.strip().lstrip("-"))


def _integer_bound(reference: str) -> int:
    """The largest magnitude an integer answer may have: one digit more than the reference's."""
    return 10 ** (_digits(reference) + 1) - 1


def answer_schema(reference: str) -> dict[str, Any]:
    """The schema of a reply to a task whose reference answer is ``reference``: worked lines, then the answer, for
    an integer; the answer alone for a string."""
    properties: dict[str, Any] = {}
    if _is_integer(reference):
        bound = _integer_bound(reference)
        properties["work"] = {"type": "array", "maxItems": _digits(reference),
                              "items": {"type": "string", "pattern": WORK_LINE_PATTERN}}
        properties["answer"] = {"type": "integer", "minimum": -bound, "maximum": bound}
    else:
        properties["answer"] = {"type": "string", "maxLength": 2 * max(len(reference), 8)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def reply_token_bound(reference: str) -> int:
    """The most tokens a compact reply valid for ``answer_schema(reference)`` can take, EOS included, for any
    tokenizer whose tokens hold at least one byte: the reply's longest length in bytes, plus one. Room for it
    costs nothing unused, since the grammar ends the reply once the object is complete."""
    if _is_integer(reference):
        lines = _digits(reference)
        work = lines * (_WORK_LINE_CHARS + 2) + max(lines - 1, 0)  # quoted lines and their commas
        length = len('{"work":[],"answer":}') + work + len(str(-_integer_bound(reference)))
    else:  # a character is at most 4 bytes of UTF-8 or a 6-byte escape
        length = len('{"answer":""}') + 6 * 2 * max(len(reference), 8)
    return length + 1


def json_task_prompt(prompt: str, reference: str) -> str:
    """The task prompt, asking for the answer as JSON in ``answer_schema(reference)``'s shape (what a program that
    calls the model would write)."""
    shape = '{"work": [...], "answer": ...}' if _is_integer(reference) else '{"answer": ...}'
    return f"{prompt}\nReply with JSON only: {shape}."


def json_answer_reply(work: str, answer: str) -> str:
    """The reply a teacher writes to ``json_task_prompt``: compact, as the server's grammar writes JSON (no
    whitespace), the work lines in order."""
    if _is_integer(answer):
        value: dict[str, Any] = {"work": [line for line in work.split("\n") if line], "answer": int(answer)}
    else:
        value = {"answer": answer}
    return json.dumps(value, separators=(",", ":"))


def answer_tool(reference: str) -> dict[str, Any]:
    """The OpenAI ``tools`` entry a tool-call probe offers: one function whose parameters are the answer object."""
    return {"type": "function", "function": {"name": ANSWER_TOOL, "description": "Submit the answer to the task.",
                                             "parameters": answer_schema(reference)}}


def json_reply_problem(text: str, schema: dict[str, Any]) -> str | None:
    """Why ``text`` is not a JSON document valid for ``schema`` (one line), or None when it is."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON ({exc.args[0] if exc.args else exc})"
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return f"invalid for its schema: {exc.message}"
    return None


def json_answer_correct(text: str, reference: str) -> bool:
    """The reply is a JSON object whose ``answer`` matches ``reference`` (as ``evals.scoring`` compares answers)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict) or "answer" not in value or isinstance(value["answer"], (dict, list, bool)):
        return False
    return answers_match(str(value["answer"]), reference)
