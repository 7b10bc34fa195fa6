"""The JSON reply contract: a held-out task asked for a JSON answer, and how such a reply is scored. Pure, no torch.

One implementation for the ``structured`` eval suite (``evals.suites.structured``) and the rollout's structured
probes (``serving.rollout.probes``), as ``evals.scoring`` is for plain replies: a reply cannot be valid for one
and invalid for the other.

The task is the held-out task itself; the reply is one object ``{"answer": X}``, X an integer where the reference
answer is one (a sum), else a string. The bounds keep a grammar from letting a model write digits or letters until
``max_tokens`` cuts the reply (a cut reply is no answer): 12 digits is more than any embedded task needs, and a
string may be twice the reference's length (at least 16 characters).
"""

from __future__ import annotations

import json
import re
from typing import Any

from evals.scoring import answers_match

ANSWER_TOOL = "submit_answer"  # the function a structured tool-call probe must call
_INTEGER_RE = re.compile(r"-?\d+")
_INTEGER_BOUND = 10**12 - 1


def answer_schema(reference: str) -> dict[str, Any]:
    """The schema of a reply to a task whose reference answer is ``reference``."""
    if _INTEGER_RE.fullmatch(reference.strip()):
        answer: dict[str, Any] = {"type": "integer", "minimum": -_INTEGER_BOUND, "maximum": _INTEGER_BOUND}
    else:
        answer = {"type": "string", "maxLength": 2 * max(len(reference), 8)}
    return {"type": "object", "properties": {"answer": answer}, "required": ["answer"], "additionalProperties": False}


def json_task_prompt(prompt: str) -> str:
    """The task prompt, asking for the answer as JSON (what a program that calls the model would write)."""
    return f'{prompt}\nReply with JSON only: {{"answer": ...}}.'


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
