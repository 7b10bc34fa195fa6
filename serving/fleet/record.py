"""What a fleet runs and where, kept in ``<root>/fleet.json`` so a later ``deploy`` command finds it again.

Written atomically on every change. A record names its backend (``local``: processes on this machine;
``ray``: actors on a Ray cluster, found again by name in the record's namespace), so the commands that
follow (``deploy status``, ``stop``, the rollout's retirement of old replicas) act on the same backend
without being told.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from artifacts.common.atomic import atomic_write_json
from serving.fleet.errors import FleetError

FLEET_FILE = "fleet.json"
BACKENDS = ("local", "ray")


@dataclass
class ReplicaRecord:
    version: str
    bundle: str
    url: str
    pid: int  # the `lifecycle serve` process (on its node, for a Ray replica)
    log: str
    served_model: str
    serve_flags: list[str] = field(default_factory=list)  # `lifecycle serve` flags beyond the fleet's own
    role: str = ""  # "" the version's own replica; "baseline": a fresh copy of the champion judged beside a canary
    actor: str = ""  # the Ray actor's name (in the fleet's namespace); "" for a local process
    node: str = ""  # the node's IP, for a Ray replica


@dataclass
class FleetRecord:
    model_name: str
    tracking_uri: str
    gateway_url: str = ""
    gateway_pid: int | None = None
    replicas: list[ReplicaRecord] = field(default_factory=list)
    rollout_dir: str | None = None  # the rollout in progress or last run
    controller_pid: int | None = None
    backend: str = "local"
    ray_address: str = ""
    ray_namespace: str = ""
    fleet_id: str = ""  # prefix of this fleet's actor names: several fleets can share one Ray cluster
    # gateways run elsewhere in front of the same replicas (their admin URLs; they accept the fleet's admin key)
    other_gateways: list[str] = field(default_factory=list)
    # each adapter's rollout in progress or last run (its public name -> the rollout's directory), and the pid of
    # its controller: adapter rollouts run in their lanes, beside the base's and one another
    adapter_rollouts: dict[str, str] = field(default_factory=dict)
    adapter_controllers: dict[str, int] = field(default_factory=dict)

    @property
    def gateway_urls(self) -> list[str]:
        return [u for u in (self.gateway_url, *self.other_gateways) if u]


def read_record(root: str | Path) -> FleetRecord:
    path = Path(root) / FLEET_FILE
    if not path.is_file():
        raise FleetError(f"{root}: no fleet here (start one with `deploy snapshot`)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        data["replicas"] = [ReplicaRecord(**r) for r in data.get("replicas", [])]
        return FleetRecord(**data)
    except (json.JSONDecodeError, TypeError) as exc:
        raise FleetError(f"{path}: cannot read the fleet record ({exc})") from None


def write_record(root: str | Path, record: FleetRecord) -> None:
    atomic_write_json(Path(root) / FLEET_FILE, asdict(record))
