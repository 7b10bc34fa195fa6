"""A fleet on this machine: the gateway and one engine process per snapshot, all on 127.0.0.1.

``deploy`` and the pipeline's rollout stage use it to put snapshots in front of traffic. Everything it
starts is a detached process with its log under ``<root>/logs``; what runs where is kept in
``<root>/fleet.json`` (written atomically), so a later ``deploy`` command finds the fleet again. The keys
live beside it: an admin key for the controller and ``deploy``, and a user key for replayed traffic,
both in 0600 files; the keys file holds only their hashes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from artifacts.common.atomic import atomic_write_json, atomic_write_text
from artifacts.common.net import free_port, wait_until_ready
from serving.rollout.state import RolloutError

FLEET_FILE = "fleet.json"


@dataclass
class ReplicaRecord:
    version: str
    bundle: str
    url: str
    pid: int
    log: str
    served_model: str
    serve_flags: list[str] = field(default_factory=list)  # `lifecycle serve` flags beyond the fleet's own
    role: str = ""  # "" the version's own replica; "baseline": a fresh copy of the champion judged beside a canary


@dataclass
class FleetRecord:
    model_name: str
    tracking_uri: str
    gateway_url: str = ""
    gateway_pid: int | None = None
    replicas: list[ReplicaRecord] = field(default_factory=list)
    rollout_dir: str | None = None  # the rollout in progress or last run
    controller_pid: int | None = None


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is not alive
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def wait_for(url: str, timeout: float, proc_pid: int | None = None, log: str | Path | None = None) -> None:
    """Return once ``url`` answers 200; a process that exits first, or the timeout, raises with its last log line."""
    alive = None if proc_pid is None else (lambda: pid_alive(proc_pid))
    if wait_until_ready(url, timeout, alive=alive, interval=0.2) is None:
        return
    tail = ""
    if log and Path(log).is_file():
        lines = [ln for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
        tail = f"; last log line: {lines[-1][:300]}" if lines else ""
    raise RolloutError(f"{url} did not answer in {timeout:.0f} s{tail}")


def warm_up(url: str, served_model: str, requests: int) -> None:
    """A few short requests straight to a replica (not through the gateway, so nothing is recorded)."""
    body = {"model": served_model, "messages": [{"role": "user", "content": "What is 12 + 30?"}],
            "max_tokens": 8, "temperature": 0}
    for _ in range(requests):
        try:
            httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        except httpx.TransportError as exc:
            raise RolloutError(f"{url}: the warm-up request failed ({type(exc).__name__})") from None


class LocalFleet:
    def __init__(self, root: str | Path, model_name: str, tracking_uri: str, *, gateway_port: int | None = None,
                 threads: int | None = 1, kv_memory: str = "128MiB") -> None:
        self.root = Path(root)
        self.model_name = model_name
        self.tracking_uri = tracking_uri
        self.gateway_port = gateway_port
        self.threads = threads
        self.kv_memory = kv_memory
        self.logs = self.root / "logs"
        self.record = self._load()

    # ----------------------------------------------------------------- files
    @property
    def record_path(self) -> Path:
        return self.root / FLEET_FILE

    @property
    def admin_key_file(self) -> Path:
        return self.root / "admin.key"

    @property
    def user_key_file(self) -> Path:
        return self.root / "traffic.key"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    def _load(self) -> FleetRecord:
        if self.record_path.is_file():
            try:
                data = json.loads(self.record_path.read_text(encoding="utf-8"))
                data["replicas"] = [ReplicaRecord(**r) for r in data.get("replicas", [])]
                record = FleetRecord(**data)
            except (json.JSONDecodeError, TypeError) as exc:
                raise RolloutError(f"{self.record_path}: cannot read the fleet record ({exc})") from None
            if record.model_name != self.model_name:
                raise RolloutError(f"{self.record_path}: this fleet serves {record.model_name!r}, not "
                                   f"{self.model_name!r} (use another --fleet directory)")
            return record
        return FleetRecord(self.model_name, self.tracking_uri)

    def save(self) -> None:
        atomic_write_json(self.record_path, asdict(self.record))

    @staticmethod
    def read(root: str | Path) -> FleetRecord:
        path = Path(root) / FLEET_FILE
        if not path.is_file():
            raise RolloutError(f"{root}: no fleet here (start one with `deploy snapshot`)")
        data = json.loads(path.read_text(encoding="utf-8"))
        data["replicas"] = [ReplicaRecord(**r) for r in data.get("replicas", [])]
        return FleetRecord(**data)

    def admin_key(self) -> str:
        return self.admin_key_file.read_text(encoding="utf-8").strip()

    def user_key(self) -> str:
        return self.user_key_file.read_text(encoding="utf-8").strip()

    def _ensure_keys(self) -> Path:
        from serving.gateway.keys import KeyStore

        keys_file = self.root / "keys.json"
        if keys_file.is_file() and self.admin_key_file.is_file() and self.user_key_file.is_file():
            return keys_file
        store = KeyStore([])
        admin = store.add("deploy", admin=True, requests_per_minute=1e6, tokens_per_minute=1e9)
        user = store.add("traffic", requests_per_minute=1e6, tokens_per_minute=1e9)
        atomic_write_text(self.admin_key_file, admin + "\n", mode=0o600)
        atomic_write_text(self.user_key_file, user + "\n", mode=0o600)
        store.save(keys_file)
        return keys_file

    # ----------------------------------------------------------------- processes
    def _spawn(self, args: list[str], log_name: str) -> tuple[int, Path]:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / log_name
        # the local fleet runs several replicas (and the gateway) on one machine's cores: their OpenMP workers
        # sleep at once instead of spinning against each other (serving.engine's default spins a little)
        env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
        with open(log, "ab") as handle:
            proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        return proc.pid, log

    def gateway_alive(self) -> bool:
        if not pid_alive(self.record.gateway_pid):
            return False
        try:
            return httpx.get(self.record.gateway_url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def ensure_gateway(self, champion: ReplicaRecord | None = None) -> str:
        """The fleet's gateway URL, starting the gateway if it is not running. A restarted gateway restores
        its persisted routing; ``champion``, when given, is what this fleet knows serves now, and wins."""
        if not self.gateway_alive():
            self._start_gateway(champion)
        if champion is not None:
            self._route_champion(champion)
        return self.record.gateway_url

    def _route_champion(self, champion: ReplicaRecord) -> None:
        from serving.rollout.gateway_client import GatewayAdmin

        gateway = GatewayAdmin(self.record.gateway_url, self.admin_key())
        try:
            if gateway.routing()["champion"]["replicas"] != [champion.url]:
                gateway.set_routing({"champion": {"replicas": [champion.url], "version": champion.version,
                                                  "served_model": champion.served_model}}, actor="fleet")
        finally:
            gateway.close()

    def _start_gateway(self, champion: ReplicaRecord | None) -> None:
        keys_file = self._ensure_keys()
        port = self.gateway_port or free_port()
        config = {"host": "127.0.0.1", "port": port, "model_name": self.model_name,
                  "state_dir": str(self.root / "gateway"), "keys_file": str(keys_file),
                  "health": {"interval_s": 0.5, "eject_after": 2}}
        if champion is not None:
            config["champion"] = {"replicas": [champion.url], "version": champion.version,
                                  "served_model": champion.served_model}
        tokenizer = Path(champion.bundle) / "tokenizer.json" if champion is not None else None
        if tokenizer is not None and tokenizer.is_file():
            config["tokenizer_file"] = str(tokenizer)
        config_path = self.root / "gateway.yaml"
        atomic_write_text(config_path, yaml.safe_dump(config, sort_keys=False))
        pid, log = self._spawn([sys.executable, "-m", "serving.gateway.cli", str(config_path)], "gateway.log")
        url = f"http://127.0.0.1:{port}"
        wait_for(url + "/health", 60, pid, log)
        self.record.gateway_url, self.record.gateway_pid = url, pid
        self.save()

    def replica(self, version: str, role: str = "") -> ReplicaRecord | None:
        for replica in self.record.replicas:
            if replica.version == str(version) and replica.role == role and pid_alive(replica.pid):
                return replica
        return None

    def start_replica(self, bundle: str | Path, version: str, timeout: float = 600,
                      serve_flags: Sequence[str] = (), role: str = "", warmup: int = 0) -> ReplicaRecord:
        """Serve a verified bundle on a free port (reusing a live replica of the same version and role).

        ``serve_flags``: more `lifecycle serve` flags for this replica (speculative decoding, step budget...);
        the fleet sets the port, name, KV memory, threads and log level itself. ``warmup`` short requests are
        sent straight to a new replica once it is ready, so its first measured requests do not pay for
        first-use costs (kernel builds, allocator growth) that an older replica paid long ago."""
        existing = self.replica(version, role)
        if existing is not None:
            return existing
        port = free_port()
        served = f"{self.model_name}-v{version}"
        args = [sys.executable, "-m", "serving.cli", "serve", str(bundle), "--port", str(port),
                "--served-model-name", served, "--kv-memory", self.kv_memory, "--log-level", "warning"]
        if self.threads:
            args += ["--threads", str(self.threads)]
        args += serve_flags
        pid, log = self._spawn(args, f"replica-v{version}{f'-{role}' if role else ''}-{port}.log")
        url = f"http://127.0.0.1:{port}"
        record = ReplicaRecord(str(version), str(bundle), url, pid, str(log), served, list(serve_flags), role)
        self.record.replicas = [r for r in self.record.replicas if pid_alive(r.pid)] + [record]
        self.save()
        try:
            wait_for(url + "/ready", timeout, pid, log)
            warm_up(url, served, warmup)
        except RolloutError:
            self.stop_replica(record)
            raise
        return record

    def start_rollout_replicas(self, bundle: str | Path, version: str, champion: ReplicaRecord,
                               serve_flags: Sequence[str] = (), warmup: int = 4
                               ) -> tuple[ReplicaRecord, ReplicaRecord]:
        """The candidate's replica and, started with it, a baseline: a fresh replica of the champion's snapshot
        with the champion's flags and the fleet's core budget, which the canary steps judge the candidate
        against (same age, same share of traffic). Both get the same warm-up."""
        candidate = self.start_replica(bundle, version, serve_flags=serve_flags, warmup=warmup)
        baseline = self.start_replica(champion.bundle, champion.version, serve_flags=champion.serve_flags,
                                      role="baseline", warmup=warmup)
        return candidate, baseline

    def stop_replica(self, replica: ReplicaRecord, grace: float = 10) -> None:
        _terminate(replica.pid, grace)
        self.record.replicas = [r for r in self.record.replicas if r.pid != replica.pid]
        self.save()

    def retire_unrouted(self, routing: dict) -> list[ReplicaRecord]:
        """Stop the replicas no variant routes to any more (a rolled-back candidate, a retired champion)."""
        routed = {url for name in ("champion", "canary", "shadow", "baseline")
                  for url in (routing.get(name) or {}).get("replicas", [])}
        retired = [r for r in self.record.replicas if r.url not in routed]
        for replica in retired:
            self.stop_replica(replica)
        return retired

    def stop_all(self) -> None:
        _terminate(self.record.controller_pid, 10)
        for replica in list(self.record.replicas):
            _terminate(replica.pid, 10)
        _terminate(self.record.gateway_pid, 10)
        self.record.replicas, self.record.gateway_pid, self.record.controller_pid = [], None, None
        self.save()


def _terminate(pid: int | None, grace: float) -> None:
    if not pid_alive(pid):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)
    if pid_alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
