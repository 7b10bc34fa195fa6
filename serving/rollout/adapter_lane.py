"""An adapter's lane on a fleet of its base: loading and unloading its versions in the base's replicas, routing the
lane, installing its first champion after a smoke check, and starting a rollout between two of its versions.

``deploy snapshot`` of an adapter and the pipeline's adapter-form rollout stage both come in here (as snapshots
both come in through `serving.rollout.start`), so the two cannot drift apart in what an adapter rollout is. An
adapter has no replicas of its own: each version is served in the base's replicas as ``NAME@VERSION``, and the
gateway's lane ``NAME`` (the adapter bundle's name, which users put in ``model``) routes between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from serving.fleet.errors import FleetError
from serving.fleet.fleet import Fleet
from serving.fleet.gateway_group import GatewayGroup
from serving.rollout.controller import Controller
from serving.rollout.install import smoke_check
from serving.rollout.plan import RolloutPlan
from serving.rollout.registry_console import RegistryConsole
from serving.rollout.state import SHADOW, RolloutSpec

CHAMPION = "champion"


def served_name(public: str, version: str) -> str:
    """How one version of an adapter is named inside the replicas (and in a lane's routing)."""
    return f"{public}@{version}"


def load_adapter(replica_url: str, served: str, bundle: str | Path, admin_key: str) -> None:
    """Load (or load again: the same name takes the new weights) an adapter into one replica."""
    try:
        response = httpx.post(f"{replica_url}/v1/load_lora_adapter", timeout=120,
                              headers={"authorization": f"Bearer {admin_key}"},
                              json={"lora_name": served, "lora_path": str(bundle)})
    except httpx.TransportError as exc:
        raise FleetError(f"{replica_url}: loading {served} failed ({type(exc).__name__})") from None
    if response.status_code == 200:
        return
    message = _error_message(response)
    if response.status_code in (401, 403) or "adapters are off" in message:
        raise FleetError(f"{replica_url}: serves no adapters ({message}); deploy the base with --max-loras N "
                         "(the fleet then gives its replicas the admin key that loads adapters)")
    raise FleetError(f"{replica_url}: loading {served} refused: {message}")


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


def lane_routing(fleet: Fleet, public: str) -> dict | None:
    """The gateway's routing of the adapter's lane, or None before its first champion."""
    gateways = fleet.gateways()
    try:
        return gateways.routing().get("lanes", {}).get(public)
    finally:
        gateways.close()


def set_lane_champion(fleet: Fleet, public: str, served: str, version: str, actor: str) -> None:
    gateways = GatewayGroup(fleet.gateway_urls, fleet.admin_key(), lane=public)
    try:
        gateways.set_routing({CHAMPION: {"replicas": [], "version": version, "served_model": served}}, actor=actor)
    finally:
        gateways.close()


def install_adapter(fleet: Fleet, console: RegistryConsole, public: str, version: str, previous: str | None,
                    actor: str, cause: str) -> None:
    """Make a loaded adapter version its lane's champion without a canary (its first version, or one deployed
    ``--as champion``): a smoke check through the gateway (in the lane's shadow, which takes no traffic), then all
    of the lane's traffic, then the registry's aliases. A failed smoke check leaves the lane as it was (a new lane
    is removed again) and raises."""
    served = served_name(public, version)
    lane = lane_routing(fleet, public)
    gateways = GatewayGroup(fleet.gateway_urls, fleet.admin_key(), lane=public)
    try:
        if lane is None:  # a lane needs a champion before anything can be pinned in it
            gateways.set_routing({CHAMPION: {"replicas": [], "version": version, "served_model": served}},
                                 actor=actor)
        else:
            gateways.set_routing({"shadow": {"replicas": [], "version": version, "served_model": served},
                                  "shadow_fraction": 0.0}, actor=actor)
        try:
            smoke_check(fleet.record.gateway_url, fleet.admin_key(), CHAMPION if lane is None else "shadow",
                        model=public)
        except Exception:
            if lane is None:
                fleet_gateways = fleet.gateways()
                try:
                    for member in fleet_gateways.members:
                        member.delete_lane(public, actor)
                finally:
                    fleet_gateways.close()
            raise
        finally:
            if lane is not None:
                gateways.set_routing({"shadow": lane["shadow"], "shadow_fraction": lane["shadow_fraction"]},
                                     actor=actor)
        gateways.set_routing({CHAMPION: {"replicas": [], "version": version, "served_model": served},
                              "canary": {"replicas": [], "version": "", "served_model": ""}, "canary_weight": 0.0},
                             actor=actor)
    finally:
        gateways.close()
    if previous is not None:
        console.set_alias("previous-champion", previous)
    console.set_alias(CHAMPION, version)
    console.set_tags(version, {"rollout.state": "champion", "lifecycle.deployed_by": actor,
                               "rollout.reason": cause})


def serve_champion_adapter(fleet: Fleet, replica_url: str, adapter_model: str, public: str, champion: str,
                           tracking_uri: str, dest: Path, actor: str) -> str:
    """A registered champion adapter the gateway has no lane for yet (a fresh fleet): fetched from the registry
    into ``dest``, loaded and routed, so a new version is rolled out against it rather than over nothing. Returns
    its served name."""
    from artifacts.registry import resolve_bundle

    bundle = resolve_bundle(f"models:/{adapter_model}/{champion}", dest, tracking_uri=tracking_uri)
    served = served_name(public, champion)
    load_adapter(replica_url, served, bundle, fleet.admin_key())
    set_lane_champion(fleet, public, served, champion, actor)
    return served


def refuse_if_rolling(fleet: Fleet, public: str) -> None:
    """One rollout per adapter at a time (several adapters may each have one)."""
    from serving.rollout.state import StateFile

    directory = fleet.record.adapter_rollouts.get(public)
    if directory and StateFile(directory).exists():
        state = StateFile(directory).load()
        if not state.terminal:
            raise FleetError(f"a rollout of {public} v{state.spec.candidate_version} is in progress ({state.phase}); "
                             f"`deploy rollback --adapter {public}` or `deploy promote --adapter {public}` it first")


def start_adapter_rollout(fleet: Fleet, *, adapter_model: str, public: str, version: str, champion: str,
                          champion_served: str, tracking_uri: str, plan: RolloutPlan, start: str = SHADOW,
                          eval_passed: bool | None = None, say: Callable[[str], None] = print) -> Controller:
    """Start rolling adapter ``version`` (already loaded in the base's replicas) out against the lane's champion
    ``champion`` (served as ``champion_served``); returns the controller in its first phase, its state under
    ``fleet.rollouts`` and named in the fleet's record (close it, or drive it on). The baseline of the canary
    steps is the champion adapter in the same replicas: both sides share every batch."""
    spec = RolloutSpec(model_name=adapter_model, candidate_version=version, champion_version=champion,
                       candidate_replicas=[], champion_replicas=[],
                       candidate_served_model=served_name(public, version), champion_served_model=champion_served,
                       lane=public, gateway_url=fleet.record.gateway_url,
                       other_gateway_urls=fleet.record.other_gateways, admin_key_file=str(fleet.admin_key_file),
                       tracking_uri=tracking_uri, plan=plan, start=start, eval_passed=eval_passed,
                       fleet_dir=str(fleet.root))
    directory = fleet.rollouts / f"{public}-v{version}-{time.strftime('%Y%m%d-%H%M%S')}"
    controller = Controller.create(directory, spec, say=say)
    fleet.record.adapter_rollouts[public] = str(directory)
    fleet.save()
    return controller


def retire_adapter(state) -> str | None:
    """At the end of an adapter's rollout: unload the version that lost (the old champion after a promotion, the
    candidate after a rollback) from the fleet's replicas. Returns its served name when it was unloaded."""
    from serving.fleet.gateway_client import read_secret

    spec = state.spec
    loser = spec.champion_served_model if state.phase == "promoted" else spec.candidate_served_model
    record = Fleet.read(spec.fleet_dir)
    admin_key = read_secret(spec.admin_key_file)
    unloaded = [unload_adapter(replica.url, loser, admin_key) for replica in record.replicas]
    return loser if any(unloaded) else None
