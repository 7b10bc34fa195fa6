"""Verifiable probes: the same held-out prompts to the champion and to the candidate, each at temperature 0 and
each task prompt several times more at the server's own sampling (no temperature in the request), and a few task
prompts asked for a JSON answer under ``response_format`` and as a required tool call.

Each sampled draw carries a seed, the same for champion and candidate (fresh at every look and in every rollout):
both sides then
sample with the same random numbers, as the gateway's shadow mirror does, so an unchanged model draws the same
answers and a changed one differs only where its distribution does. Each side still samples from its own served
distribution; what the seed removes is the noise of two independent draws, which on 160 draws a side read ±0.055
against a 0.05 tolerance and made an unchanged model's shadow phase extend one time in five (RESULTS.md, "Rollout
calibration with latency power"). Each draw's outcome is kept, so the sampled gate compares the two sides draw by
draw (`paired_rates`).

Live traffic has no reference answers, so the behaviour gates that need one (task accuracy, refusals of
harmful prompts, over-refusal of benign look-alikes, the reply format) come from these probes, scored by
the project's one reply contract (``evals.scoring``). The probes go through the gateway pinned to a variant
and marked as probes, so they exercise the real serving path without counting as user traffic.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from evals.json_replies import (
    ANSWER_TOOL,
    answer_schema,
    answer_tool,
    json_answer_correct,
    json_reply_problem,
    json_task_prompt,
    reply_token_bound,
)
from evals.scoring import is_correct, is_format_adherent, is_refusal
from serving.fleet.gateway_client import GatewayAdmin
from serving.fleet.gateway_group import GatewayGroup
from serving.rollout.paired_rates import UNANSWERED
from serving.rollout.plan import Probes
from serving.rollout.state import RolloutError

STRUCTURED_KINDS = frozenset({"json", "tool"})
# what a call in the fallback format adds around its arguments: [{"name":"submit_answer","arguments":...}]
TOOL_CALL_WRAP_TOKENS = len('[{"name":"","arguments":}]') + len(ANSWER_TOOL)
INVALID = ""  # what a structured probe answered without JSON scores as: not JSON, so invalid
NOT_APPLICABLE = object()  # a structured probe the snapshot's context cannot hold


@dataclass
class ProbeItem:
    # task | sampled (a task prompt at the served sampling) | harmful | lookalike | json (a task prompt under a
    # JSON schema) | tool (a task prompt whose answer is a call of the one tool offered)
    kind: str
    prompt: str
    answer: str = ""
    draw: int = 0  # a sampled probe's number among the sampled probes: with a look's salt, its seed


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
    # each sampled draw's outcome, by draw number (1 right, 0 wrong, UNANSWERED), and how many draws a prompt has:
    # champion and candidate answer a draw with one seed, so the sampled gate compares them draw by draw
    sampled_draws: list[int] = field(default_factory=list)
    samples_per_prompt: int = 0
    # task prompts drawn from per look, and the looks whose draws ``sampled_draws`` holds (``pool_sampled``):
    # draw ``i`` is a draw of prompt ``(i // samples_per_prompt) % sampled_prompts``
    sampled_prompts: int = 0
    sampled_looks: int = 1
    harmful: int = 0
    refused_harmful: int = 0
    lookalike: int = 0
    refused_lookalike: int = 0
    # JSON and tool-call probes answered; valid: a reply (or the call's arguments) valid for the schema, the tool
    # named; a 400 for the response_format or the tools is answered and invalid (the snapshot refused the feature)
    structured: int = 0
    structured_valid: int = 0
    structured_correct: int = 0
    errors: int = 0
    task_errors: int = 0
    sampled_errors: int = 0
    harmful_errors: int = 0
    lookalike_errors: int = 0
    structured_errors: int = 0
    # structured probes whose prompt the snapshot's context cannot hold (a 400 naming the prompt: the fallback's
    # tool listing is ~360 tokens on the embedded tokenizer, its context 256): neither sent nor answered
    structured_not_applicable: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def pool_sampled(earlier: dict[str, Any], latest: dict[str, Any]) -> dict[str, Any]:
    """``latest`` (a ``ProbeScore.to_json``) with the sampled draws of ``earlier`` looks put before its own.

    The sampled probes draw afresh at every look, so a look judged on its own draws gives a candidate just past the
    tolerance a fresh chance to read within it at every look (2 of 10 at +0.074 against 0.05 were promoted that
    way: RESULTS.md, "Sampled probes, draw by draw"). Pooled, every look adds evidence instead of a new sample,
    and the prompts stay the clusters. The greedy probes are not pooled: at temperature 0 a look repeats the last
    one's answers, which would be the same evidence counted twice. ``latest`` is returned as it is when the two
    were drawn differently (other prompts or draws per prompt), or ``earlier`` kept no draws."""
    same_draws = (earlier.get("samples_per_prompt") == latest.get("samples_per_prompt")
                  and earlier.get("sampled_prompts") == latest.get("sampled_prompts"))
    if not same_draws or not earlier.get("sampled_draws") or not latest.get("sampled_prompts"):
        return latest
    pooled = dict(latest)
    pooled["sampled_draws"] = list(earlier["sampled_draws"]) + list(latest["sampled_draws"])
    pooled["sampled_looks"] = earlier.get("sampled_looks", 1) + latest.get("sampled_looks", 1)
    for counter in ("sampled", "sampled_correct", "sampled_errors"):
        pooled[counter] = earlier.get(counter, 0) + latest.get(counter, 0)
    return pooled


def load_probes(spec: Probes) -> list[ProbeItem]:
    if not spec.data_dir:
        return []
    root = Path(spec.data_dir)
    items: list[ProbeItem] = []
    try:
        heldout = _jsonl(root / "tasks_heldout.jsonl")
        tasks = heldout[:spec.tasks]
        items += [ProbeItem("task", r["prompt"], str(r["answer"])) for r in tasks]
        items += [ProbeItem("sampled", r["prompt"], str(r["answer"]), draw=i * spec.samples + j)
                  for i, r in enumerate(tasks) for j in range(spec.samples)]
        safety = _jsonl(root / "safety_heldout.jsonl")
        harmful = [r for r in safety if r.get("should_refuse")]
        benign = [r for r in safety if not r.get("should_refuse")]
        half = spec.safety // 2
        items += [ProbeItem("harmful", r["prompt"]) for r in harmful[:spec.safety - min(half, len(benign))]]
        items += [ProbeItem("lookalike", r["prompt"]) for r in benign[:half]]
        items += [ProbeItem(kind, r["prompt"], str(r["answer"])) for kind in ("json", "tool")
                  for r in heldout[:spec.structured]]
    except (KeyError, TypeError) as exc:
        raise RolloutError(f"{root}: probe files lack a field ({exc})") from None
    return items


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise RolloutError(f"{path}: probe file missing (plan.probes.data_dir must be a data-stage output)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def probe_seed(item: ProbeItem, salt: str) -> int:
    """A sampled probe's seed: the same for every variant probed with one ``salt`` (a rollout's look), another for
    every draw, every look (a look that re-probes draws afresh, not the same answers again) and every rollout (two
    rollouts are two samples, as a calibration counts them). 56 bits: within the signed 64-bit range the API takes."""
    digest = hashlib.sha256(f"{salt}/{item.draw}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


def structured_max_tokens(item: ProbeItem) -> int:
    """Room for the longest reply a structured probe's grammar allows (`reply_token_bound`), so no valid reply is
    cut: a grammar ends the reply once it is complete, so the room costs nothing unused."""
    wrap = TOOL_CALL_WRAP_TOKENS if item.kind == "tool" else 0
    return reply_token_bound(item.answer) + wrap


def probe_body(item: ProbeItem, max_tokens: int, salt: str = "") -> dict[str, Any]:
    """The chat request a probe sends: greedy except the sampled probes, which leave the sampling to the
    snapshot's served defaults and carry their seed (`probe_seed`); a JSON probe names its schema, a tool probe
    offers one tool and requires it."""
    prompt = json_task_prompt(item.prompt, item.answer) if item.kind == "json" else item.prompt
    if item.kind in STRUCTURED_KINDS:
        max_tokens = max(max_tokens, structured_max_tokens(item))
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    if item.kind != "sampled":
        body["temperature"] = 0
    else:
        body["seed"] = probe_seed(item, salt)
    if item.kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "answer", "strict": True, "schema": answer_schema(item.answer)}}
    elif item.kind == "tool":
        body["tools"] = [answer_tool(item.answer)]
        body["tool_choice"] = {"type": "function", "function": {"name": ANSWER_TOOL}}
        body["parallel_tool_calls"] = False  # one answer, one call
    return body


def structured_reply(item: ProbeItem, choice: dict[str, Any]) -> str | None:
    """The JSON a structured probe's answer carries: the reply itself (a JSON probe that finished), or the
    arguments of the one call of the answer tool (a tool probe); None when there is none."""
    if item.kind == "json":
        return choice["message"]["content"] if choice.get("finish_reason") == "stop" else None
    calls = choice["message"].get("tool_calls") or []
    if len(calls) != 1 or calls[0]["function"]["name"] != ANSWER_TOOL:
        return None
    return calls[0]["function"]["arguments"]


def run_probes(gateway: GatewayAdmin | GatewayGroup, variant: str, items: list[ProbeItem], spec: Probes,
               salt: str = "") -> ProbeScore:
    """Send ``items`` to ``variant`` and score the answers. ``salt`` seeds the sampled probes (`probe_seed`): give
    every variant probed at one look the same, and each look its own."""
    def ask(item: ProbeItem) -> tuple[ProbeItem, Any, bool]:  # the reply: text, None (no answer), NOT_APPLICABLE
        try:
            response = gateway.ask(variant, probe_body(item, spec.max_tokens, salt))
        except httpx.HTTPError:  # unreachable, timed out, broke off: a probe error, counted
            return item, None, False
        if item.kind in STRUCTURED_KINDS and response.status_code == 400:
            if _too_long(response):  # the tool listing does not fit a small model's context: not applicable
                return item, NOT_APPLICABLE, False
            return item, INVALID, False  # the snapshot refused the response_format or the tools: answered, invalid
        if response.status_code != 200:
            return item, None, False
        try:
            choice = response.json()["choices"][0]
            if item.kind in STRUCTURED_KINDS:
                return item, structured_reply(item, choice) or INVALID, True
            return item, choice["message"]["content"] or "", choice.get("finish_reason") == "stop"
        except (ValueError, LookupError, TypeError):  # a 200 that is not a chat completion: a probe error
            return item, None, False

    sampled = sum(item.kind == "sampled" for item in items)
    score = ProbeScore(samples_per_prompt=spec.samples, sampled_prompts=sampled // spec.samples if spec.samples else 0)
    score.sampled_draws = [UNANSWERED] * sampled
    with ThreadPoolExecutor(spec.concurrency) as pool:
        for item, reply, stopped in pool.map(ask, items):
            if reply is NOT_APPLICABLE:
                score.structured_not_applicable += 1
                continue
            if reply is None:
                score.errors += 1
                kind_errors = f"{_score_kind(item.kind)}_errors"
                setattr(score, kind_errors, getattr(score, kind_errors) + 1)
                continue
            if item.kind in STRUCTURED_KINDS:
                valid = json_reply_problem(reply, answer_schema(item.answer)) is None
                score.structured += 1
                score.structured_valid += valid
                score.structured_correct += valid and json_answer_correct(reply, item.answer)
            elif item.kind == "task":
                score.tasks += 1
                score.correct += is_correct(reply, item.answer)
                score.formatted += is_format_adherent(reply, stopped)
            elif item.kind == "sampled":
                right = is_correct(reply, item.answer)
                score.sampled += 1
                score.sampled_correct += right
                score.sampled_draws[item.draw] = int(right)
            elif item.kind == "harmful":
                score.harmful += 1
                score.refused_harmful += is_refusal(reply)
            else:
                score.lookalike += 1
                score.refused_lookalike += is_refusal(reply)
    return score


def _score_kind(kind: str) -> str:
    """The counters a probe kind is scored under: JSON and tool probes share ``structured``."""
    return "structured" if kind in STRUCTURED_KINDS else kind


def _too_long(response: httpx.Response) -> bool:
    """A 400 that says the prompt does not fit the model's context (``serving.engine.limits``)."""
    try:
        error = response.json()["error"]
    except (ValueError, LookupError, TypeError):
        return False
    return isinstance(error, dict) and error.get("param") == "prompt" and "context length" in str(error.get("message"))
