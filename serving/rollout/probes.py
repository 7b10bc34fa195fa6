"""Verifiable probes: the same held-out prompts to the champion and to the candidate, each at temperature 0 and
each task prompt several times more at the server's own sampling (no temperature in the request).

Live traffic has no reference answers, so the behaviour gates that need one (task accuracy, refusals of
harmful prompts, over-refusal of benign look-alikes, the reply format) come from these probes, scored by
the project's one reply contract (``evals.scoring``). The probes go through the gateway pinned to a variant
and marked as probes, so they exercise the real serving path without counting as user traffic.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from evals.scoring import is_correct, is_format_adherent, is_refusal
from serving.fleet.gateway_client import GatewayAdmin
from serving.fleet.gateway_group import GatewayGroup
from serving.rollout.plan import Probes
from serving.rollout.state import RolloutError


@dataclass
class ProbeItem:
    kind: str  # task | sampled (a task prompt at the served sampling) | harmful | lookalike
    prompt: str
    answer: str = ""


@dataclass
class ProbeScore:
    """Counts for one variant; rates are derived, so two variants compare on the same denominators.

    ``tasks``, ``harmful`` and ``lookalike`` count the probes that were *answered*: a probe that got no reply
    (unreachable, an error status, a body that is not a chat completion) is not a wrong answer or a harmful
    one answered, it is no evidence at all. It is counted under its kind's ``*_errors`` and shown with the
    verdicts, whose minimum sample then decides whether what was answered is enough."""

    tasks: int = 0
    correct: int = 0
    formatted: int = 0
    sampled: int = 0  # task prompts answered at the served sampling
    sampled_correct: int = 0
    harmful: int = 0
    refused_harmful: int = 0
    lookalike: int = 0
    refused_lookalike: int = 0
    errors: int = 0
    task_errors: int = 0
    sampled_errors: int = 0
    harmful_errors: int = 0
    lookalike_errors: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def load_probes(spec: Probes) -> list[ProbeItem]:
    if not spec.data_dir:
        return []
    root = Path(spec.data_dir)
    items: list[ProbeItem] = []
    try:
        tasks = _jsonl(root / "tasks_heldout.jsonl")[:spec.tasks]
        items += [ProbeItem("task", r["prompt"], str(r["answer"])) for r in tasks]
        items += [ProbeItem("sampled", r["prompt"], str(r["answer"])) for r in tasks for _ in range(spec.samples)]
        safety = _jsonl(root / "safety_heldout.jsonl")
        harmful = [r for r in safety if r.get("should_refuse")]
        benign = [r for r in safety if not r.get("should_refuse")]
        half = spec.safety // 2
        items += [ProbeItem("harmful", r["prompt"]) for r in harmful[:spec.safety - min(half, len(benign))]]
        items += [ProbeItem("lookalike", r["prompt"]) for r in benign[:half]]
    except (KeyError, TypeError) as exc:
        raise RolloutError(f"{root}: probe files lack a field ({exc})") from None
    return items


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise RolloutError(f"{path}: probe file missing (plan.probes.data_dir must be a data-stage output)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_probes(gateway: GatewayAdmin | GatewayGroup, variant: str, items: list[ProbeItem], spec: Probes) -> ProbeScore:
    def ask(item: ProbeItem) -> tuple[ProbeItem, str | None, bool]:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": item.prompt}], "max_tokens": spec.max_tokens}
        if item.kind != "sampled":  # sampled probes leave the sampling to the snapshot's served defaults
            body["temperature"] = 0
        try:
            response = gateway.ask(variant, body)
        except httpx.HTTPError:  # unreachable, timed out, broke off: a probe error, counted
            return item, None, False
        if response.status_code != 200:
            return item, None, False
        try:
            choice = response.json()["choices"][0]
            return item, choice["message"]["content"] or "", choice.get("finish_reason") == "stop"
        except (ValueError, LookupError, TypeError):  # a 200 that is not a chat completion: a probe error
            return item, None, False

    score = ProbeScore()
    with ThreadPoolExecutor(spec.concurrency) as pool:
        for item, reply, stopped in pool.map(ask, items):
            if reply is None:
                score.errors += 1
                kind_errors = f"{item.kind}_errors"
                setattr(score, kind_errors, getattr(score, kind_errors) + 1)
                continue
            if item.kind == "task":
                score.tasks += 1
                score.correct += is_correct(reply, item.answer)
                score.formatted += is_format_adherent(reply, stopped)
            elif item.kind == "sampled":
                score.sampled += 1
                score.sampled_correct += is_correct(reply, item.answer)
            elif item.kind == "harmful":
                score.harmful += 1
                score.refused_harmful += is_refusal(reply)
            else:
                score.lookalike += 1
                score.refused_lookalike += is_refusal(reply)
    return score
