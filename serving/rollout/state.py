"""The rollout's persisted state: where it is, what it decided, and the transition in progress.

Written atomically after every change, so a controller killed at any instant restarts where it was.
A transition (routing change, alias moves, version tags, audit entry) is first written down as
``pending`` and only then applied; a restart finds it and applies what is left. Alias moves check the
registry first, so re-applying a transition never moves an alias twice.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from artifacts.common.atomic import atomic_write_json
from artifacts.errors import LifecycleError
from serving.rollout.plan import RolloutPlan

# phases
BASELINE, SHADOW, CANARY, AWAITING_APPROVAL, PAUSED, BAKE = "baseline", "shadow", "canary", "awaiting_approval", \
    "paused", "bake"
PROMOTED, ROLLED_BACK = "promoted", "rolled_back"
TERMINAL = (PROMOTED, ROLLED_BACK)
STATE_FILE = "state.json"


class RolloutError(LifecycleError):
    """A rollout cannot start or go on (no gateway, a version that is not registered, a bad state file)."""


@dataclass
class RolloutSpec:
    """Everything the controller needs to run a rollout, fixed when it starts."""

    model_name: str  # the registered model
    candidate_version: str
    champion_version: str
    candidate_replicas: list[str]
    champion_replicas: list[str]
    candidate_served_model: str = ""
    champion_served_model: str = ""
    # fresh replicas of the champion's snapshot, started with the candidate's: in canary steps they take the
    # canary's share and every systems gate compares the canary with them (none: with the champion pool)
    baseline_replicas: list[str] = field(default_factory=list)
    gateway_url: str = "http://127.0.0.1:8080"
    admin_key_file: str = ""
    tracking_uri: str = ""
    plan: RolloutPlan = field(default_factory=RolloutPlan)
    start: str = SHADOW  # "shadow" (with its noise floor first) or "canary" (skip the shadow phase)
    eval_passed: bool | None = None  # the candidate's offline gates, when known locally
    fleet_dir: str = ""  # a local fleet whose retired replicas the flow stops at the end
    # more gateways in front of the same replicas: each routing change goes to every one, and a phase is judged
    # on the requests all of them saw
    other_gateway_urls: list[str] = field(default_factory=list)
    # an adapter's rollout: the adapter's public name (its lane at the gateway). Champion and candidate are adapter
    # versions inside the base's replicas (their served models), so both replica lists are empty, and the
    # baseline is the champion adapter on those same replicas, taking the canary's share
    lane: str = ""

    @property
    def gateways(self) -> list[str]:
        return [self.gateway_url, *self.other_gateway_urls]

    @property
    def has_baseline(self) -> bool:
        """Canary steps compare the candidate with a baseline of equal share: fresh replicas of the champion's
        snapshot, or, for an adapter, the champion adapter in the same replicas (the same batches)."""
        return bool(self.baseline_replicas) or bool(self.lane)


@dataclass
class AliasMove:
    alias: str
    version: str | None  # None: delete the alias
    done: bool = False
    moved: bool = False  # False once done means it was already in place (a person, or a run before a restart)
    ours: bool = False  # already in place because this rollout put it there earlier: nothing to record
    previous: str | None = None


@dataclass
class Transition:
    id: str
    to_phase: str
    cause: str
    actor: str
    at: float
    routing: dict[str, Any]
    aliases: list[AliasMove]
    step_index: int
    routing_done: bool = False
    recorded: bool = False


@dataclass
class RolloutState:
    id: str
    spec: RolloutSpec
    phase: str = BASELINE
    step_index: int = -1  # index into plan.steps while in canary (and after it)
    phase_started_at: float = 0.0
    extensions: int = 0
    # windows added for the gates with a design effect alone (plan.max_evidence_extensions), and the seconds they
    # added to the phase
    evidence_extensions: int = 0
    evidence_extra_seconds: float = 0.0
    resume_to: str | None = None  # the phase a pause or approval returns to
    reason: str = ""
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    floor: dict[str, Any] | None = None  # champion-vs-champion agreement counts
    probes: dict[str, Any] | None = None  # probe results per variant, measured once
    analyses: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    pending: Transition | None = None
    mlflow_run_id: str | None = None
    unhealthy_since: float | None = None
    # what this rollout itself last set each alias to: a move that finds the alias already there is news
    # only when someone else (a person, or this rollout before a restart) put it there
    aliases_set: dict[str, str | None] = field(default_factory=dict)
    # gate -> {"actor", "at", "cause"}: gates a person waived (deploy resume --waive, the rollout.waive tag);
    # a waived gate is still measured and shown, but an inconclusive or advisory result no longer holds the
    # rollout (a failed critical gate is never waived: that needs promote)
    waivers: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    @property
    def weight(self) -> float:
        steps = self.spec.plan.steps
        if self.phase in (CANARY, AWAITING_APPROVAL, PAUSED) and 0 <= self.step_index < len(steps):
            return steps[self.step_index].weight
        return 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutState:
        data = dict(data)
        for old, new in (("rate_extensions", "evidence_extensions"), ("rate_extra_seconds", "evidence_extra_seconds")):
            if old in data:  # a state written before the latency gates shared the rate gates' extensions
                data.setdefault(new, data.pop(old))
        spec = dict(data["spec"])
        spec["plan"] = RolloutPlan.from_json(spec.get("plan", {}))
        data["spec"] = RolloutSpec(**spec)
        pending = data.get("pending")
        if pending:
            pending = dict(pending)
            pending["aliases"] = [AliasMove(**a) for a in pending.get("aliases", [])]
            data["pending"] = Transition(**pending)
        return cls(**data)


def phase_exit_status(phase: str) -> int:
    """What a command that drove or followed a rollout exits with: 0 promoted, 3 rolled back, 4 still running,
    paused or waiting for a person."""
    return {PROMOTED: 0, ROLLED_BACK: 3}.get(phase, 4)


def new_rollout_id(candidate_version: str) -> str:
    return f"v{candidate_version}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


class StateFile:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / STATE_FILE

    def exists(self) -> bool:
        return self.path.is_file()

    def load(self) -> RolloutState:
        try:
            return RolloutState.from_json(json.loads(self.path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError, TypeError, KeyError, ValueError) as exc:
            raise RolloutError(f"{self.path}: cannot read the rollout state ({exc})") from None

    def save(self, state: RolloutState) -> None:
        atomic_write_json(self.path, state.to_json())
