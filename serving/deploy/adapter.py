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
from pathlib import Path

from serving.cli import ServeError
from serving.deploy.control import actor, fleet_dir, follow, spawn_controller
from serving.deploy.release_gates import check_install, release_verdict, waived_gates
from serving.rollout.adapter_lane import (
    CHAMPION,
    install_adapter,
    lane_routing,
    load_adapter,
    refuse_if_rolling,
    serve_champion_adapter,
    served_name,
    set_lane_champion,
    start_adapter_rollout,
)


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
    served = served_name(public, version)
    console = RegistryConsole(adapter_model, tracking_uri)
    champion = console.alias_version(CHAMPION)
    refuse_if_rolling(fleet, public)
    load_adapter(replica.url, served, bundle, fleet.admin_key())
    print(f"loaded {served} into the champion's replica v{base_champion} ({replica.url})", flush=True)
    fleet.ensure_gateway()
    lane = lane_routing(fleet, public)
    if champion == version:
        if lane is None or lane["champion"]["served_model"] != served:
            set_lane_champion(fleet, public, served, version, actor())
        print(f"{adapter_model} v{version} is already champion; serving it as model {public!r} at "
              f"{fleet.record.gateway_url}/v1")
        return 0
    if champion is None or args.role == CHAMPION:  # no canary to judge it: its release gates, as for a snapshot
        waived_cause = check_install(release_verdict(console, version, bundle), version, waived_gates(args.waive),
                                     console, actor())
        cause = ("first champion of the adapter" if champion is None else f"deployed with --as champion over "
                 f"v{champion}") + waived_cause
        install_adapter(fleet, console, public, version, champion, actor(), cause)
        print(f"{adapter_model} v{version} is champion ({cause}); smoke check passed; serving it as model "
              f"{public!r} at {fleet.record.gateway_url}/v1")
        return 0
    if lane is None or not lane["champion"]["served_model"]:
        dest = Path(args.dest) if args.dest else _deployments()
        serve_champion_adapter(fleet, replica.url, adapter_model, public, champion, tracking_uri, dest, actor())
        print(f"champion {adapter_model} v{champion} loaded and routed as model {public!r}", flush=True)
        lane = lane_routing(fleet, public)
    return _start_rollout(args, fleet, console, adapter_model, public, version, champion,
                          lane["champion"]["served_model"], tracking_uri)


def _deployments() -> Path:
    from artifacts.common.workdir import resolve_workdir

    return resolve_workdir().deployments


def _start_rollout(args: argparse.Namespace, fleet, console, adapter_model: str, public: str, version: str,
                   champion: str, champion_served: str, tracking_uri: str) -> int:
    from serving.deploy.rollout_plan import rollout_plan

    controller = start_adapter_rollout(fleet, adapter_model=adapter_model, public=public, version=version,
                                       champion=champion, champion_served=champion_served,
                                       tracking_uri=tracking_uri, plan=rollout_plan(args, console, version),
                                       start="canary" if args.role == "canary" else "shadow",
                                       say=lambda line: print(line, flush=True))
    controller.close()
    fleet.record.adapter_controllers[public] = spawn_controller(fleet, controller.files.dir)
    fleet.save()
    print(f"rollout {controller.state.id}: {adapter_model} v{version} against champion v{champion}, in the "
          f"replicas of the base, as model {public!r} (MLflow run {controller.state.mlflow_run_id}); follow it with "
          "`deploy status`")
    if args.wait:
        return follow(controller.files.dir)
    return 0
