"""`deploy snapshot` of a LoRA adapter: load it into the replicas of the base it was trained on, then put it in
front of that adapter's users the way a snapshot is: the first version (or one deployed ``--as champion``) after a
smoke check, a later one by a rollout in the adapter's lane at the gateway (``docs/rollout.md#adapter-lanes``).

The fleet is the base's: an adapter has no replicas of its own. Its public name is the adapter bundle's name
(``support``); each version is served in the replicas as ``support@VERSION``, so champion and candidate live side
by side in the same batches. Refused, with one line each: a fleet of another base model, a base whose champion is
not the snapshot the adapter was trained on (both digests named), replicas started without adapter slots, and a
second rollout of the same adapter while one is in progress.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx

from serving.cli import ServeError
from serving.deploy.control import actor, fleet_dir, follow, spawn_controller
from serving.deploy.release_gates import check_install, release_verdict, waived_gates

CHAMPION = "champion"


def deploy_adapter(args: argparse.Namespace, bundle: Path, adapter_model: str, version: str,
                   tracking_uri: str) -> int:
    from artifacts.adapter_bundle import check_base, verify_adapter_bundle
    from artifacts.adapter_registry import adapter_base
    from serving.fleet.fleet import Fleet
    from serving.fleet.record import FLEET_FILE
    from serving.rollout.registry_console import RegistryConsole

    manifest = verify_adapter_bundle(bundle)
    root = fleet_dir(args)
    if not (root / FLEET_FILE).is_file():
        raise ServeError(f"{root}: no fleet serves a base here; deploy the base {manifest.base.name} first "
                         "(`deploy snapshot` with --max-loras N), then its adapters")
    record = Fleet.read(root)
    base_model, _, _ = adapter_base(adapter_model, version, tracking_uri)
    if base_model != record.model_name:
        raise ServeError(f"models:/{adapter_model}/{version} is an adapter of {base_model!r}; the fleet in {root} "
                         f"serves {record.model_name!r}")
    fleet = Fleet(root, record.model_name, tracking_uri)
    base_champion = RegistryConsole(record.model_name, tracking_uri).alias_version(CHAMPION)
    replica = fleet.replica(base_champion) if base_champion else None
    if replica is None:
        raise ServeError(f"{record.model_name}: no live replica of the champion (v{base_champion}) to load "
                         "the adapter into; `deploy snapshot` the base first")
    check_base(manifest, Path(replica.bundle))  # another snapshot than it was trained on: both digests named
    public = manifest.name
    served = f"{public}@{version}"
    console = RegistryConsole(adapter_model, tracking_uri)
    champion = console.alias_version(CHAMPION)
    _refuse_if_rolling(fleet, public)
    admin_key = fleet.admin_key()
    load_adapter(replica.url, served, bundle, admin_key)
    print(f"loaded {served} into the champion's replica v{base_champion} ({replica.url})", flush=True)
    fleet.ensure_gateway()
    lane = _lane(fleet, public)
    if champion == version:
        if lane is None or lane["champion"]["served_model"] != served:
            _set_lane_champion(fleet, public, served, version)
        print(f"{adapter_model} v{version} is already champion; serving it as model {public!r} at "
              f"{fleet.record.gateway_url}/v1")
        return 0
    if champion is None or args.role == CHAMPION:  # no canary to judge it: its release gates, as for a snapshot
        waived_cause = check_install(release_verdict(console, version, bundle), version, waived_gates(args.waive),
                                     console, actor())
        return _install(fleet, console, public, served, version, lane, champion, waived_cause)
    if lane is None or not lane["champion"]["served_model"]:
        _serve_champion(fleet, replica.url, adapter_model, public, champion, tracking_uri, admin_key, args)
        lane = _lane(fleet, public)
    return _start_rollout(args, fleet, console, adapter_model, public, version, served, champion,
                          lane["champion"]["served_model"], tracking_uri)


def load_adapter(replica_url: str, served: str, bundle: Path, admin_key: str) -> None:
    """Load (or load again: the same name takes the new weights) an adapter into one replica."""
    try:
        response = httpx.post(f"{replica_url}/v1/load_lora_adapter", timeout=120,
                              headers={"authorization": f"Bearer {admin_key}"},
                              json={"lora_name": served, "lora_path": str(bundle)})
    except httpx.TransportError as exc:
        raise ServeError(f"{replica_url}: loading {served} failed ({type(exc).__name__})") from None
    if response.status_code == 200:
        return
    message = _error_message(response)
    if response.status_code in (401, 403) or "adapters are off" in message:
        raise ServeError(f"{replica_url}: serves no adapters ({message}); deploy the base with --max-loras N "
                         "(the fleet then gives its replicas the admin key that loads adapters)")
    raise ServeError(f"{replica_url}: loading {served} refused: {message}")


def unload_adapter(replica_url: str, served: str, admin_key: str) -> bool:
    """Unload ``served`` from one replica; False when it was not loaded there (or the replica is gone)."""
    try:
        response = httpx.post(f"{replica_url}/v1/unload_lora_adapter", timeout=60,
                              headers={"authorization": f"Bearer {admin_key}"}, json={"lora_name": served})
    except httpx.TransportError:
        return False
    return response.status_code == 200


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _lane(fleet, public: str) -> dict | None:
    gateways = fleet.gateways()
    try:
        return gateways.routing().get("lanes", {}).get(public)
    finally:
        gateways.close()


def _set_lane_champion(fleet, public: str, served: str, version: str) -> None:
    from serving.fleet.gateway_group import GatewayGroup

    gateways = GatewayGroup(fleet.gateway_urls, fleet.admin_key(), lane=public)
    try:
        gateways.set_routing({CHAMPION: {"replicas": [], "version": version, "served_model": served}},
                             actor=actor())
    finally:
        gateways.close()


def _install(fleet, console, public: str, served: str, version: str, lane: dict | None,
             previous: str | None, waived_cause: str = "") -> int:
    """The adapter's first version, or one deployed ``--as champion``: a smoke check of the adapter through the
    gateway (in the lane's shadow, which takes no traffic), then all of the adapter's traffic, then the alias."""
    from serving.fleet.gateway_group import GatewayGroup
    from serving.rollout.install import smoke_check

    gateways = GatewayGroup(fleet.gateway_urls, fleet.admin_key(), lane=public)
    try:
        if lane is None:  # a lane needs a champion before anything can be pinned in it
            gateways.set_routing({CHAMPION: {"replicas": [], "version": version, "served_model": served}},
                                 actor=actor())
        else:
            gateways.set_routing({"shadow": {"replicas": [], "version": version, "served_model": served},
                                  "shadow_fraction": 0.0}, actor=actor())
        try:
            smoke_check(fleet.record.gateway_url, fleet.admin_key(), CHAMPION if lane is None else "shadow",
                        model=public)
        except Exception:
            if lane is None:
                fleet_gateways = fleet.gateways()
                try:
                    for member in fleet_gateways.members:
                        member.delete_lane(public, actor())
                finally:
                    fleet_gateways.close()
            raise
        finally:
            if lane is not None:
                gateways.set_routing({"shadow": lane["shadow"], "shadow_fraction": lane["shadow_fraction"]},
                                     actor=actor())
        gateways.set_routing({CHAMPION: {"replicas": [], "version": version, "served_model": served},
                              "canary": {"replicas": [], "version": "", "served_model": ""}, "canary_weight": 0.0},
                             actor=actor())
    finally:
        gateways.close()
    if previous is not None:
        console.set_alias("previous-champion", previous)
    console.set_alias(CHAMPION, version)
    console.set_tags(version, {"rollout.state": "champion", "lifecycle.deployed_by": actor()})
    cause = ("first champion of the adapter" if previous is None else f"deployed with --as champion over "
             f"v{previous}") + waived_cause
    print(f"{console.model_name} v{version} is champion ({cause}); smoke check passed; serving it as model "
          f"{public!r} at {fleet.record.gateway_url}/v1")
    return 0


def _serve_champion(fleet, replica_url: str, adapter_model: str, public: str, champion: str, tracking_uri: str,
                    admin_key: str, args: argparse.Namespace) -> None:
    """A registered champion adapter the gateway has no lane for yet (a fresh fleet): loaded and routed first, so
    the new version is rolled out against it rather than over nothing."""
    from artifacts.common.workdir import resolve_workdir
    from artifacts.registry import resolve_bundle

    dest = Path(args.dest) if args.dest else resolve_workdir().deployments
    bundle = resolve_bundle(f"models:/{adapter_model}/{champion}", dest, tracking_uri=tracking_uri)
    served = f"{public}@{champion}"
    load_adapter(replica_url, served, bundle, admin_key)
    _set_lane_champion(fleet, public, served, champion)
    print(f"champion {adapter_model} v{champion} loaded and routed as model {public!r}", flush=True)


def _refuse_if_rolling(fleet, public: str) -> None:
    from serving.rollout.state import StateFile

    directory = fleet.record.adapter_rollouts.get(public)
    if directory and StateFile(directory).exists():
        state = StateFile(directory).load()
        if not state.terminal:
            raise ServeError(f"a rollout of {public} v{state.spec.candidate_version} is in progress ({state.phase}); "
                             f"`deploy rollback --adapter {public}` or `deploy promote --adapter {public}` it first")


def _start_rollout(args: argparse.Namespace, fleet, console, adapter_model: str, public: str, version: str,
                   served: str, champion: str, champion_served: str, tracking_uri: str) -> int:
    from serving.deploy.rollout_plan import rollout_plan
    from serving.rollout.controller import Controller
    from serving.rollout.state import RolloutSpec

    plan = rollout_plan(args, console, version)
    spec = RolloutSpec(model_name=adapter_model, candidate_version=version, champion_version=champion,
                       candidate_replicas=[], champion_replicas=[], candidate_served_model=served,
                       champion_served_model=champion_served, lane=public, gateway_url=fleet.record.gateway_url,
                       other_gateway_urls=fleet.record.other_gateways, admin_key_file=str(fleet.admin_key_file),
                       tracking_uri=tracking_uri, plan=plan, start="canary" if args.role == "canary" else "shadow",
                       fleet_dir=str(fleet.root))
    directory = fleet.rollouts / f"{public}-v{version}-{time.strftime('%Y%m%d-%H%M%S')}"
    controller = Controller.create(directory, spec, say=lambda line: print(line, flush=True))
    controller.close()
    fleet.record.adapter_rollouts[public] = str(directory)
    fleet.record.adapter_controllers[public] = spawn_controller(fleet, directory)
    fleet.save()
    print(f"rollout {controller.state.id}: {adapter_model} v{version} against champion v{champion}, in the "
          f"replicas of the base, as model {public!r} (MLflow run {controller.state.mlflow_run_id}); follow it with "
          "`deploy status`")
    if args.wait:
        return follow(directory)
    return 0


def retire_adapter(state) -> str | None:
    """At the end of an adapter's rollout: unload the version that lost (the old champion after a promotion, the
    candidate after a rollback) from the fleet's replicas. Returns its served name when it was unloaded."""
    from serving.fleet.fleet import Fleet
    from serving.fleet.gateway_client import read_secret

    spec = state.spec
    loser = spec.champion_served_model if state.phase == "promoted" else spec.candidate_served_model
    record = Fleet.read(spec.fleet_dir)
    admin_key = read_secret(spec.admin_key_file)
    unloaded = [unload_adapter(replica.url, loser, admin_key) for replica in record.replicas]
    return loser if any(unloaded) else None
