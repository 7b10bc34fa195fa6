"""A fleet: the gateway, and one engine replica per snapshot, on a backend (``local`` or ``ray``).

``deploy`` and the pipeline's rollout stage use it to put snapshots in front of traffic. The gateway is a
detached process on this machine with its log under ``<root>/logs``; the replicas run where the backend
puts them (``replica_backend.py``: processes on 127.0.0.1; ``ray_backend.py``: Ray actors on a cluster).
What runs where is kept in ``<root>/fleet.json`` (``record.py``), so a later ``deploy`` command finds
the fleet again, on the same backend. The keys live beside it: an admin key for the controller, ``deploy``
and registering replicas, and a user key for replayed traffic, both in 0600 files; the keys file holds only
their hashes. Gateways run elsewhere in front of the same replicas (``other_gateways``) get every routing
change the fleet makes.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from artifacts.common.atomic import atomic_write_text
from artifacts.common.net import free_port
from serving.fleet.errors import FleetError
from serving.fleet.gateway_group import GatewayGroup
from serving.fleet.record import BACKENDS, FleetRecord, ReplicaRecord, read_record, write_record
from serving.fleet.replica_backend import (
    LocalBackend,
    ReplicaBackend,
    ReplicaLaunch,
    pid_alive,
    spawn,
    terminate,
    wait_for,
)

FLEET_ACTOR = "fleet"


def warm_up(url: str, served_model: str, requests: int) -> None:
    """A few short requests straight to a replica (not through the gateway, so nothing is recorded)."""
    body = {"model": served_model, "messages": [{"role": "user", "content": "What is 12 + 30?"}],
            "max_tokens": 8, "temperature": 0}
    for _ in range(requests):
        try:
            httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        except httpx.TransportError as exc:
            raise FleetError(f"{url}: the warm-up request failed ({type(exc).__name__})") from None


class Fleet:
    """``backend``: ``local`` or ``ray`` for a new fleet (None: the record's, else local); an existing fleet
    keeps its own, and naming another is an error. ``ray_address`` (default ``$RAY_ADDRESS``, else ``auto``)
    is the cluster a ``ray`` fleet joins."""

    def __init__(self, root: str | Path, model_name: str, tracking_uri: str, *, backend: str | None = None,
                 ray_address: str | None = None, gateway_port: int | None = None, threads: int | None = 1,
                 kv_memory: str = "128MiB", other_gateways: Sequence[str] = ()) -> None:
        self.root = Path(root)
        self.model_name = model_name
        self.tracking_uri = tracking_uri
        self.gateway_port = gateway_port
        self.threads = threads
        self.kv_memory = kv_memory
        self.logs = self.root / "logs"
        self.record = self._load(backend, ray_address)
        self.record.other_gateways = list(dict.fromkeys([*self.record.other_gateways,
                                                         *(u.rstrip("/") for u in other_gateways)]))
        self.backend = self._make_backend()

    # ----------------------------------------------------------------- files
    @property
    def admin_key_file(self) -> Path:
        return self.root / "admin.key"

    @property
    def user_key_file(self) -> Path:
        return self.root / "traffic.key"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def gateway_urls(self) -> list[str]:
        """Every gateway in front of this fleet: its own first, then the others."""
        return self.record.gateway_urls

    def _load(self, backend: str | None, ray_address: str | None) -> FleetRecord:
        if backend is not None and backend not in BACKENDS:
            raise FleetError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if (self.root / "fleet.json").is_file():
            record = read_record(self.root)
            if record.model_name != self.model_name:
                raise FleetError(f"{self.root}: this fleet serves {record.model_name!r}, not "
                                   f"{self.model_name!r} (use another --fleet directory)")
            if backend is not None and backend != record.backend and record.replicas:
                raise FleetError(f"{self.root}: this fleet runs on the {record.backend} backend, not {backend} "
                                   "(`deploy stop` it first, or use another --fleet directory)")
        else:
            record = FleetRecord(self.model_name, self.tracking_uri)
        record.backend = backend or record.backend
        if record.backend == "ray":
            record.ray_address = ray_address or record.ray_address or os.environ.get("RAY_ADDRESS") or "auto"
            record.ray_namespace = record.ray_namespace or "llm-lifecycle"
            record.fleet_id = record.fleet_id or f"{_slug(self.model_name)}-{uuid.uuid4().hex[:6]}"
        return record

    def _make_backend(self) -> ReplicaBackend:
        if self.record.backend == "ray":
            from serving.fleet.ray_backend import RayBackend  # imports Ray: only for a Ray fleet

            return RayBackend(self.record.ray_address, self.record.ray_namespace, self.record.fleet_id, self.logs)
        return LocalBackend(self.logs)

    def save(self) -> None:
        write_record(self.root, self.record)

    @staticmethod
    def read(root: str | Path) -> FleetRecord:
        return read_record(root)

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

    def connect(self) -> None:
        """Check the backend answers (a Ray cluster at its address) before anything starts."""
        self.backend.connect()
        if not self.record.gateway_url:  # fixed now: Ray replicas are told where to register before it starts
            port = self.gateway_port or free_port(self.backend.gateway_host())
            self.record.gateway_url = f"http://{self.backend.gateway_host()}:{port}"

    def gateways(self) -> GatewayGroup:
        """Every gateway in front of the fleet, driven as one (close it after use)."""
        return GatewayGroup(self.gateway_urls, self.admin_key())

    # ----------------------------------------------------------------- the gateway
    def gateway_alive(self) -> bool:
        if not pid_alive(self.record.gateway_pid):
            return False
        try:
            return httpx.get(self.record.gateway_url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def ensure_gateway(self, champion: ReplicaRecord | None = None) -> str:
        """The fleet's gateway URL, starting the gateway if it is not running. A restarted gateway restores
        its persisted routing; ``champion``, when given, is what this fleet knows serves now, and wins on every
        gateway. Each gateway learns where the fleet's named (Ray) replicas answer."""
        if not self.gateway_alive():
            self._start_gateway(champion)
        gateways = self.gateways()
        try:
            for replica in self.record.replicas:
                if replica.actor:
                    gateways.register_replica(replica.actor, replica.url, FLEET_ACTOR)
            if champion is not None:
                route = {"champion": {"replicas": [champion.url], "version": champion.version,
                                      "served_model": champion.served_model}}
                for gateway in gateways.members:
                    if gateway.routing()["champion"]["replicas"] != [champion.url]:
                        gateway.set_routing(route, actor=FLEET_ACTOR)
        finally:
            gateways.close()
        return self.record.gateway_url

    def _start_gateway(self, champion: ReplicaRecord | None) -> None:
        self.connect()
        keys_file = self._ensure_keys()
        address = urlsplit(self.record.gateway_url)
        if not _bindable(address.hostname, address.port):  # the old port was taken meanwhile: a new one
            self.record.gateway_url = f"http://{address.hostname}:{free_port(address.hostname)}"
            address = urlsplit(self.record.gateway_url)
        config = {"host": address.hostname, "port": address.port, "model_name": self.model_name,
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
        pid, log = spawn([sys.executable, "-m", "serving.gateway.cli", str(config_path)], self.logs / "gateway.log")
        self.record.gateway_pid = pid
        self.save()
        wait_for(self.record.gateway_url + "/health", 60, pid, log)

    # ----------------------------------------------------------------- replicas
    def _live(self, replica: ReplicaRecord) -> bool:
        """Whether the replica still exists; its URL is brought up to date (a Ray replica may have moved)."""
        url = self.backend.locate(replica)
        if url is not None:
            replica.url = url
        return url is not None

    def replica(self, version: str, role: str = "") -> ReplicaRecord | None:
        for replica in self.record.replicas:
            known = replica.url
            if replica.version == str(version) and replica.role == role and self._live(replica):
                if replica.url != known:
                    self.save()
                return replica
        return None

    def start_replica(self, bundle: str | Path, version: str, timeout: float = 600,
                      serve_flags: Sequence[str] = (), role: str = "", warmup: int = 0) -> ReplicaRecord:
        """Serve a verified bundle (reusing a live replica of the same version and role).

        ``serve_flags``: more `lifecycle serve` flags for this replica (speculative decoding, step budget...);
        the fleet sets the port, name, KV memory, threads and log level itself. ``warmup`` short requests are
        sent straight to a new replica once it is ready, so its first measured requests do not pay for
        first-use costs (kernel builds, allocator growth) that an older replica paid long ago."""
        existing = self.replica(version, role)
        if existing is not None:
            return existing
        record = self._launch(bundle, version, serve_flags, role)
        self._until_ready([record], timeout, warmup)
        return record

    def start_rollout_replicas(self, bundle: str | Path, version: str, champion: ReplicaRecord,
                               serve_flags: Sequence[str] = (), warmup: int = 4, timeout: float = 600
                               ) -> tuple[ReplicaRecord, ReplicaRecord]:
        """The candidate's replica and, started with it, a baseline: a fresh replica of the champion's snapshot
        with the champion's flags and the fleet's core budget, which the canary steps judge the candidate
        against (same age, same share of traffic). Both get the same warm-up. The two boot side by side (a
        replica's start is mostly imports and loading, one core each), so a rollout waits for one start, not
        two."""
        candidate = self.replica(version, "")
        baseline = self.replica(champion.version, "baseline")
        launched = []
        if candidate is None:
            candidate = self._launch(bundle, version, serve_flags, "")
            launched.append(candidate)
        if baseline is None:
            try:
                baseline = self._launch(champion.bundle, champion.version, champion.serve_flags, "baseline")
            except FleetError:
                for record in launched:
                    self.stop_replica(record)
                raise
            launched.append(baseline)
        self._until_ready(launched, timeout, warmup)
        return candidate, baseline

    def _launch(self, bundle: str | Path, version: str, serve_flags: Sequence[str], role: str) -> ReplicaRecord:
        """Start a replica's process (or actor) and record it; it is not ready yet."""
        self.connect()
        served = f"{self.model_name}-v{version}"
        args = [str(bundle), "--served-model-name", served, "--kv-memory", self.kv_memory, "--log-level", "warning"]
        if self.threads:
            args += ["--threads", str(self.threads)]
        args += serve_flags
        self._ensure_keys()
        if _serves_adapters(serve_flags) and "--admin-key-file" not in serve_flags:
            # adapters are loaded into a replica while it serves (`deploy snapshot` of an adapter), with the key
            # the fleet's controller and `deploy` already hold
            args += ["--admin-key-file", str(self.admin_key_file)]
        launch = ReplicaLaunch(str(version), str(bundle), role, served, args, list(serve_flags), self.threads,
                               f"replica-v{version}{f'-{role}' if role else ''}.log", self.gateway_urls,
                               self.admin_key())
        self.record.replicas = [r for r in self.record.replicas if self._live(r)]
        record = self.backend.start(launch)
        self.record.replicas.append(record)
        self.save()
        return record

    def _until_ready(self, records: Sequence[ReplicaRecord], timeout: float, warmup: int) -> None:
        """Wait for each new replica to answer, then warm it up; if one fails, all of them are stopped."""
        try:
            for record in records:
                self.backend.wait_ready(record, timeout)
                warm_up(record.url, record.served_model, warmup)
        except FleetError:
            for record in records:
                self.stop_replica(record)
            raise

    def stop_replica(self, replica: ReplicaRecord, grace: float = 10) -> None:
        self.backend.stop(replica, grace)
        self.record.replicas = [r for r in self.record.replicas if _identity(r) != _identity(replica)]
        self.save()
        if replica.actor and self.gateway_alive():
            gateways = self.gateways()
            try:
                gateways.forget_replica(replica.actor, FLEET_ACTOR)
            except FleetError:
                pass  # a gateway that does not answer keeps a stale name: harmless, it routes by URL
            finally:
                gateways.close()

    def retire_unrouted(self, routing: dict | None = None) -> list[ReplicaRecord]:
        """Stop the replicas no variant routes to any more (a rolled-back candidate, a retired champion).
        ``routing`` is what the gateways route now; read from them when not given."""
        if routing is None:
            gateways = self.gateways()
            try:
                routing = gateways.routing()
            finally:
                gateways.close()
        routed = {url for name in ("champion", "canary", "shadow", "baseline")
                  for url in (routing.get(name) or {}).get("replicas", [])}
        self.record.replicas = [r for r in self.record.replicas if self._live(r)]
        retired = [r for r in self.record.replicas if r.url not in routed]
        for replica in retired:
            self.stop_replica(replica)
        return retired

    def stop_all(self) -> list[str]:
        """Stop the controller, every replica and the gateway; returns what could not be stopped (a Ray cluster
        that no longer answers keeps its actors, and the record keeps them, so a later stop can retry)."""
        terminate(self.record.controller_pid, 10)
        for pid in self.record.adapter_controllers.values():
            terminate(pid, 10)
        problems, kept = [], []
        for replica in list(self.record.replicas):
            try:
                self.backend.stop(replica, 10)
            except FleetError as exc:
                problems.append(f"replica v{replica.version} ({replica.url}): {exc}")
                kept.append(replica)
        if not problems:
            try:
                self.backend.stop_strays(kept)
            except FleetError as exc:
                problems.append(str(exc))
        terminate(self.record.gateway_pid, 10)
        self.record.replicas, self.record.gateway_pid, self.record.controller_pid = kept, None, None
        self.record.adapter_controllers = {}
        self.save()
        return problems


def _serves_adapters(serve_flags: Sequence[str]) -> bool:
    return any(flag in ("--max-loras", "--lora-modules") for flag in serve_flags)


def _identity(replica: ReplicaRecord) -> tuple:
    return (replica.actor, replica.pid) if not replica.actor else (replica.actor,)


def _bindable(host: str, port: int) -> bool:
    """Whether a server could listen there now (as uvicorn binds: with SO_REUSEADDR, past TIME_WAIT)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:24] or "fleet"
