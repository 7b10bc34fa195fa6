"""The routing state (who serves what, at which weight) and the sticky canary split.

Sticky split: each conversation key (``X-Session-Id``, else the request's ``user``, else the API key)
hashes to a bucket in [0, 10000); buckets below ``canary_weight × 100`` go to the canary. The hash is
salted per rollout (``split_salt``), so each rollout samples different users, but within a rollout a
key keeps its bucket: one conversation never flips between models, and raising the weight from w1 to
w2 moves exactly the keys whose bucket lies in [w1, w2) — nobody already on the canary comes back.

Baseline: while a ``baseline`` variant is routed (a fresh replica of the champion's snapshot, started with
the canary), it takes the same share as the canary from the *top* of the bucket range, so the canary is
judged against a replica of equal standing (same age, same traffic share) rather than against the
long-running champion pool (Kayenta's and Argo's Experiments' rule). Keys move only between the champion
pool and the baseline, which serve the same snapshot, so no conversation ever sees its model change. Above
50% the baseline takes what is left (``100 - canary_weight``).

Several gateways in front of one fleet agree on every conversation: the bucket is a SHA-256 of the salt and
the key (no per-process hash seed, no per-gateway state), and the controller pushes the same salt and weights
to each gateway.

Named replicas: a replica that can come back elsewhere (a Ray actor restarted on another port or node) tells
the gateway where it answers now (``register``). The gateway swaps the new address in wherever the old one
was routed, and remembers the move, so a later routing change that still names the old address (a
controller holding the URLs its rollout started with) reaches the replica where it is.

Adapter lanes: each LoRA adapter the champion's replicas serve can have a public name of its own, routed by a
``Lane`` of its own (``RoutingState.lanes``): its variants are adapter versions inside the champion's replicas,
split with its own weight and salt, so an adapter is rolled out like a snapshot, and several at once.

The state is persisted with an atomic write on every change, with a generation number so two writers
(a person and the controller) cannot silently overwrite each other (the admin API checks it).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from artifacts.common.atomic import atomic_write_json
from artifacts.errors import ConfigError

BUCKETS = 10_000
STATE_FILE = "routing.json"
VARIANT_NAMES = ("champion", "canary", "shadow", "baseline")


@dataclass
class Variant:
    replicas: list[str] = field(default_factory=list)
    version: str = ""
    served_model: str = ""

    @property
    def active(self) -> bool:
        return bool(self.replicas)


@dataclass
class Fault:
    """A drill, not a bug: added delay before forwarding, a share of requests failed (HTTP 503), and a floor on the
    gap between streamed tokens (a slower decode with the same time to first token). A floor, not a delay added to
    each token: while the gateway waits the replica goes on decoding, so a fixed per-token sleep only shifts the
    stream and leaves the gaps as they were."""

    delay_ms: float = 0.0
    abort_percent: float = 0.0
    token_gap_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.token_gap_ms < 0 or not 0 <= self.abort_percent <= 100:
            raise ValueError("fault: delay_ms and token_gap_ms must be >= 0, abort_percent in [0, 100]")

    @property
    def active(self) -> bool:
        return self.delay_ms > 0 or self.abort_percent > 0 or self.token_gap_ms > 0


@dataclass
class Lane:
    """Who serves one public model, at which weight: the variants, the canary's share, the shadow's, the salt.

    The gateway's own public model is the ``RoutingState`` itself (a lane with replicas). Each adapter served
    on the champion's replicas is a lane of its own in ``RoutingState.lanes``: its variants are adapter versions
    *inside those replicas* (``served_model`` is the name the replicas load it under), so a lane's variants have
    no replicas of their own, and one is active when it names a served model. Several lanes, each with its own
    canary weight and salt, let several adapter rollouts run at once beside a rollout of the base."""

    champion: Variant = field(default_factory=Variant)
    canary: Variant = field(default_factory=Variant)
    shadow: Variant = field(default_factory=Variant)
    baseline: Variant = field(default_factory=Variant)  # the champion's snapshot, the canary's share
    canary_weight: float = 0.0  # percent of conversations
    shadow_fraction: float = 0.0  # share of champion requests mirrored
    split_salt: str = "default"
    faults: dict[str, Fault] = field(default_factory=dict)

    def variant(self, name: str) -> Variant:
        if name not in VARIANT_NAMES:
            raise KeyError(name)
        return getattr(self, name)

    def active(self, name: str) -> bool:
        """Takes traffic when routed: a base variant with replicas, an adapter lane's with a served model."""
        return self.variant(name).active

    @property
    def baseline_weight(self) -> float:
        """The baseline's share: the canary's, or what the canary leaves above 50%."""
        if not (self.active("baseline") and self.active("canary")):
            return 0.0
        return min(self.canary_weight, 100.0 - self.canary_weight)

    def validate(self, where: str = "") -> None:
        if not 0.0 <= self.canary_weight <= 100.0:
            raise ValueError(f"{where}canary_weight: must be in [0, 100], got {self.canary_weight}")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ValueError(f"{where}shadow_fraction: must be in [0, 1], got {self.shadow_fraction}")
        for name in self.faults:
            if name not in VARIANT_NAMES:
                raise ValueError(f"{where}faults: unknown variant {name!r}")


class AdapterLane(Lane):
    """A lane whose variants are adapters inside the champion's replicas: active when it names a served model."""

    def active(self, name: str) -> bool:
        return bool(self.variant(name).served_model)


@dataclass
class RoutingState(Lane):
    model_name: str = ""  # the public model id; "" → the champion's served model
    lanes: dict[str, AdapterLane] = field(default_factory=dict)  # public adapter name → its lane
    generation: int = 0
    updated_at: float = 0.0
    updated_by: str = ""
    replica_names: dict[str, str] = field(default_factory=dict)  # a named replica → where it answers now
    moved: dict[str, str] = field(default_factory=dict)  # an address a named replica left → where it answers now

    @property
    def public_model(self) -> str:
        return self.model_name or self.champion.served_model or "default"

    def lane(self, model: str | None) -> tuple[str, Lane] | None:
        """The lane a request's ``model`` names (``""`` for the public model, which no ``model`` names too)."""
        if model is None or model == self.public_model:
            return "", self
        lane = self.lanes.get(model)
        return (model, lane) if lane is not None else None

    def lane_state(self, lane: str) -> Lane:
        """The lane of a request admitted for ``lane`` (``""``: the base); one removed since routes nowhere."""
        return self if not lane else self.lanes.get(lane, AdapterLane())

    def validate(self, where: str = "") -> None:
        super().validate(where)
        for name in VARIANT_NAMES:
            for url in self.variant(name).replicas:
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise ValueError(f"{name}.replicas: {url!r} is not an http(s) URL")
        for public, lane in self.lanes.items():
            if public == self.public_model:
                raise ValueError(f"lanes: {public!r} is the base's public model name")
            lane.validate(f"lanes.{public}.")

    def register(self, name: str, url: str) -> str | None:
        """Replica ``name`` answers at ``url`` now; returns the address it left, when it moved, after routing
        ``url`` wherever that address was routed."""
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"replica {name!r}: {url!r} is not an http(s) URL")
        old = self.replica_names.get(name)
        self.replica_names[name] = url
        self.moved.pop(url, None)  # an address in use again is nobody's old one
        if old is None or old == url:
            return None
        self.moved = {src: (url if dst == old else dst) for src, dst in self.moved.items()}
        self.moved[old] = url
        self.follow_moves()
        return old

    def forget(self, name: str) -> None:
        """A named replica that was stopped: its name and the moves that lead to it go."""
        url = self.replica_names.pop(name, None)
        self.moved = {src: dst for src, dst in self.moved.items() if dst != url}

    def follow_moves(self) -> None:
        """Route each moved replica at the address it answers at now."""
        for name in VARIANT_NAMES:
            variant = self.variant(name)
            variant.replicas = list(dict.fromkeys(self.moved.get(url, url) for url in variant.replicas))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoutingState:
        try:
            data = _with_variants(data)
            data["lanes"] = {public: adapter_lane_from_json(lane, f"lanes.{public}.")
                             for public, lane in (data.get("lanes") or {}).items()}
            state = cls(**data)
        except TypeError as exc:
            raise ValueError(f"routing state: {exc}") from None
        for name in VARIANT_NAMES:
            state.variant(name).replicas = [u.rstrip("/") for u in state.variant(name).replicas]
        state.follow_moves()
        state.validate()
        return state


def adapter_lane_from_json(data: object, where: str) -> AdapterLane:
    """An adapter lane from its JSON; a lane naming replicas of its own is refused (it has none)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where[:-1]}: a lane is an object of variants and weights")
    try:
        lane = AdapterLane(**_with_variants(data))
    except TypeError as exc:
        raise ValueError(f"{where}{exc}") from None
    for name in VARIANT_NAMES:
        if lane.variant(name).replicas:
            raise ValueError(f"{where}{name}.replicas: an adapter lane is served by the champion's replicas and "
                             "has none of its own")
    lane.validate(where)
    return lane


def _with_variants(data: dict[str, Any]) -> dict[str, Any]:
    """A lane's JSON with its variants and faults as objects (TypeError on an unknown field)."""
    data = dict(data)
    for name in VARIANT_NAMES:
        data[name] = Variant(**(data.get(name) or {}))
    data["faults"] = {k: Fault(**v) for k, v in (data.get("faults") or {}).items()}
    return data


def bucket_of(salt: str, key: str) -> int:
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def choose_variant(state: Lane, conversation_key: str | None, rng: random.Random | None = None) -> str:
    """``"canary"``, ``"baseline"`` or ``"champion"`` for one request of a lane; sticky when a conversation key is
    known."""
    if not state.active("canary") or state.canary_weight <= 0:
        return "champion"
    canary_below = round(state.canary_weight * BUCKETS / 100)
    baseline_from = BUCKETS - round(state.baseline_weight * BUCKETS / 100)
    if conversation_key is None:
        bucket = (rng or random).random() * BUCKETS
    else:
        bucket = bucket_of(state.split_salt, conversation_key)
    if bucket < canary_below:
        return "canary"
    return "baseline" if bucket >= baseline_from else "champion"


class RoutingStore:
    """The routing state on disk: loaded at start, written atomically on every change."""

    def __init__(self, state_dir: str | Path, initial: RoutingState) -> None:
        self.path = Path(state_dir) / STATE_FILE
        if self.path.is_file():
            try:
                self.state = RoutingState.from_json(json.loads(self.path.read_text(encoding="utf-8")))
            except (json.JSONDecodeError, ValueError) as exc:
                raise ConfigError(f"{self.path}: cannot restore the routing state ({exc}); fix or remove it") \
                    from None
            self.restored = True
        else:
            self.state = initial
            self.restored = False
            self.save()

    def save(self) -> None:
        atomic_write_json(self.path, self.state.to_json())

    def replace(self, new: RoutingState, actor: str) -> RoutingState:
        new.validate()
        new.generation = self.state.generation + 1
        new.updated_at = time.time()
        new.updated_by = actor
        self.state = new
        self.save()
        return new
