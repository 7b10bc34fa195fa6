"""The one door into a rollout on a fleet: the champion's replica (found or started from the registry), the
candidate's and a fresh baseline replica of the champion, the gateway, the ``RolloutSpec`` and its state
directory, and the controller's first phase. ``deploy snapshot`` and the pipeline's rollout stage both come
in here, so the two cannot drift apart in what a rollout is started with."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from serving.fleet.fleet import Fleet
from serving.rollout.controller import Controller
from serving.rollout.install import install_champion
from serving.rollout.plan import RolloutPlan
from serving.rollout.state import SHADOW, RolloutSpec


def start_rollout(fleet: Fleet, *, model_name: str, version: str, bundle: str | Path, champion: str,
                  tracking_uri: str, plan: RolloutPlan, start: str = SHADOW, eval_passed: bool | None = None,
                  serve_flags: Sequence[str] = (), say: Callable[[str], None] = print) -> Controller:
    """Start rolling ``version`` (served from ``bundle``) out against ``champion`` on ``fleet``; returns the
    controller, in its first phase, with its state under ``fleet.rollouts`` (close it, or drive it on)."""
    from artifacts.common.workdir import resolve_workdir
    from artifacts.registry import resolve_bundle

    champion_replica = fleet.replica(champion)
    if champion_replica is None:
        champion_bundle = resolve_bundle(f"models:/{model_name}/{champion}", resolve_workdir().deployments,
                                         tracking_uri=tracking_uri)
        champion_replica = fleet.start_replica(champion_bundle, champion)
    url = fleet.ensure_gateway(champion=champion_replica)
    candidate, baseline = fleet.start_rollout_replicas(bundle, version, champion_replica,
                                                       serve_flags=serve_flags)
    say(f"baseline for the canary steps: a fresh replica of v{champion} at {baseline.url}")
    spec = RolloutSpec(model_name=model_name, candidate_version=version, champion_version=champion,
                       candidate_replicas=[candidate.url], champion_replicas=[champion_replica.url],
                       candidate_served_model=candidate.served_model,
                       champion_served_model=champion_replica.served_model, baseline_replicas=[baseline.url],
                       gateway_url=url, other_gateway_urls=fleet.record.other_gateways,
                       admin_key_file=str(fleet.admin_key_file), tracking_uri=tracking_uri, plan=plan,
                       start=start, eval_passed=eval_passed, fleet_dir=str(fleet.root))
    directory = fleet.rollouts / f"v{version}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Controller.create(directory, spec, say=say)


def install_on_fleet(fleet: Fleet, *, model_name: str, version: str, bundle: str | Path, tracking_uri: str,
                     cause: str, actor: str, first: bool, serve_flags: Sequence[str] = ()) -> dict:
    """Serve ``version`` on ``fleet`` and make it champion after a smoke check, without a canary (the first
    champion of a model, or a deliberate ``--as champion``); the replicas nothing routes to then retire.
    Returns ``install_champion``'s record plus the gateway's ``url``."""
    replica = fleet.start_replica(bundle, version, serve_flags=serve_flags)
    # a first champion is routed when the gateway starts; over a champion, the smoke check routes it
    url = fleet.ensure_gateway(champion=replica if first else None)
    result = install_champion(model_name=model_name, version=version, replica_url=replica.url,
                              served_model=replica.served_model, gateway_url=url, admin_key=fleet.admin_key(),
                              tracking_uri=tracking_uri, cause=cause, actor=actor,
                              other_gateway_urls=fleet.record.other_gateways)
    fleet.retire_unrouted()
    return {**result, "url": url}
