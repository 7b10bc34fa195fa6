"""`deploy snapshot SOURCE`: resolve the snapshot to a local bundle, verify it in full, then put it in front of
traffic. The first snapshot of a model becomes champion after a smoke check (so does one deployed
``--as champion``), unless its release failed its gates (``release_gates.py``: refused unless waived); a later
one gets a replica beside the champion's, a baseline replica of the champion, and a rollout run by the
controller in the background (``control.py``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from artifacts.common.workdir import resolve_tracking_uri, resolve_workdir
from serving.cli import ServeError, add_serve_arguments, engine_config_from_args
from serving.deploy.control import actor, fleet_dir, follow, spawn_controller
from serving.deploy.release_gates import check_install, release_verdict, waived_gates
from serving.deploy.standalone import serve_standalone


def deploy_snapshot(args: argparse.Namespace) -> int:
    from artifacts.adapter_bundle import is_adapter_bundle, verify_adapter_bundle
    from artifacts.verify import verify_bundle

    tracking_uri = _tracking_uri(args)
    source: str = args.model
    from_registry = source.startswith("models:/")
    if not from_registry and not Path(source).is_dir():
        raise ServeError(f"{source}: neither a bundle directory nor a models:/ URI")
    if not from_registry and not (Path(source) / "manifest.json").is_file() and not is_adapter_bundle(source):
        raise ServeError(f"{source}: not a bundle (no manifest.json); `lifecycle serve` serves plain model dirs")
    ray_address = None if args.dry_run or args.standalone else _ray_address(args)
    if ray_address is not None:  # a Ray cluster that does not answer is one line, before anything is registered
        from serving.fleet.ray_backend import DEFAULT_NAMESPACE, connect

        connect(ray_address, DEFAULT_NAMESPACE)
    if not from_registry and is_adapter_bundle(source):
        bundle, model_name, version = _register_adapter(args, Path(source).resolve(), tracking_uri)
    else:
        bundle, model_name, version = _resolve(args, source, tracking_uri)
    if is_adapter_bundle(bundle):
        adapter = verify_adapter_bundle(bundle)
        print(f"verified adapter {adapter.name} {adapter.version} (rank {adapter.lora.rank}, on base "
              f"{adapter.base.name} {adapter.base.version}) at {bundle}"
              + (f" = models:/{model_name}/{version}" if version else ""), flush=True)
        if args.dry_run:
            return 0
        if args.standalone:
            raise ServeError(f"{source}: an adapter is served in its base's replicas, not alone "
                             "(`lifecycle serve BASE --lora-modules NAME=DIR` serves both without a fleet)")
        from serving.deploy.adapter import deploy_adapter

        return deploy_adapter(args, bundle, model_name, version, tracking_uri)
    manifest = verify_bundle(bundle)
    quant = manifest.quantization.method if manifest.quantization else "none"
    print(f"verified {manifest.name} {manifest.version} ({quant}) at {bundle}"
          + (f" = models:/{model_name}/{version}" if version else ""), flush=True)
    if args.dry_run:
        return 0
    if args.standalone:
        return serve_standalone(args, bundle, manifest.name, source if from_registry else None, tracking_uri)
    return _into_fleet(args, bundle, model_name, version, tracking_uri)


def _tracking_uri(args: argparse.Namespace) -> str:
    return resolve_tracking_uri(args.tracking_uri)


def _ray_address(args: argparse.Namespace) -> str | None:
    """The cluster a Ray fleet joins (--ray-address, else the fleet's own, else $RAY_ADDRESS, else auto, as
    ``Fleet`` chooses it); None for a local fleet."""
    from serving.fleet.record import FLEET_FILE, read_record

    recorded = read_record(fleet_dir(args)) if (fleet_dir(args) / FLEET_FILE).is_file() else None
    backend = args.backend or (recorded.backend if recorded else "local")
    if backend != "ray":
        return None
    return args.ray_address or (recorded.ray_address if recorded else "") or os.environ.get("RAY_ADDRESS") or "auto"


def _resolve(args: argparse.Namespace, source: str, tracking_uri: str) -> tuple[Path, str, str | None]:
    """The verified local bundle, its registered model name, and its version (registering a dir if needed)."""
    from artifacts.registry import get_version, resolve_bundle

    dest = Path(args.dest) if args.dest else resolve_workdir().deployments
    if source.startswith("models:/"):
        ref = get_version(source, tracking_uri)
        return resolve_bundle(source, dest, tracking_uri=tracking_uri), ref.name, ref.version
    bundle = Path(source).resolve()
    if args.dry_run or args.standalone:
        return bundle, "", None
    from artifacts.manifest import read_manifest
    from artifacts.registry import find_version_by_digest, register_bundle

    name = args.model_name or read_manifest(bundle).name
    ref = find_version_by_digest(bundle, name, tracking_uri)
    if ref is None:
        ref = register_bundle(bundle, name, tracking_uri=tracking_uri,
                              description=f"{name}: registered by `deploy snapshot` from {bundle}")
        print(f"registered {bundle} as models:/{name}/{ref.version}", flush=True)
    return bundle, name, ref.version


def _register_adapter(args: argparse.Namespace, bundle: Path, tracking_uri: str) -> tuple[Path, str, str | None]:
    """An adapter bundle directory: its registered version of ``--model-name`` (default ``NAME-adapter``),
    registered against the fleet's base model when it is not yet."""
    from artifacts.adapter_bundle import read_adapter_manifest
    from artifacts.adapter_registry import register_adapter_bundle
    from artifacts.registry import find_version_by_digest
    from serving.fleet.record import FLEET_FILE, read_record

    name = args.model_name or f"{read_adapter_manifest(bundle).name}-adapter"
    if args.dry_run or args.standalone:
        return bundle, name, None
    ref = find_version_by_digest(bundle, name, tracking_uri)
    if ref is None:
        root = fleet_dir(args)
        if not (root / FLEET_FILE).is_file():
            raise ServeError(f"{root}: no fleet serves a base here; deploy the base first, then its adapters")
        ref = register_adapter_bundle(bundle, name, base_model=read_record(root).model_name,
                                      tracking_uri=tracking_uri)
        print(f"registered {bundle} as models:/{name}/{ref.version}", flush=True)
    return bundle, name, ref.version


# serve flags the fleet sets itself on every replica: the rest of what `deploy snapshot` was given goes on to
# the snapshot's replica (see replica_serve_flags)
_FLEET_OWNED = frozenset({"model", "host", "port", "served_model_name", "kv_memory", "threads", "log_level"})
_PATH_VALUED = frozenset({"speculative_model", "admin_key_file"})
_NAMED_PATHS = frozenset({"lora_modules"})  # NAME=DIR items


def replica_serve_flags(args: argparse.Namespace) -> list[str]:
    """The `lifecycle serve` flags of this command that differ from serve's defaults, as the replica's command
    line: `deploy snapshot B --speculative-tokens 4 --speculative-model D` serves B's replica with speculation.
    Paths become absolute (a replica does not start in this directory)."""
    reference = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(reference)
    flags: list[str] = []
    for action in reference._actions:
        if not action.option_strings or action.dest in _FLEET_OWNED:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true
            flags.append(action.option_strings[0])
        elif isinstance(value, list):  # nargs="+": one flag, each item after it
            items = [_absolute_named_path(v) if action.dest in _NAMED_PATHS else str(v) for v in value]
            flags += [action.option_strings[0], *items]
        else:
            text = str(Path(value).resolve()) if action.dest in _PATH_VALUED else str(value)
            flags += [action.option_strings[0], text]
    return flags


def _absolute_named_path(item: str) -> str:
    """``NAME=DIR`` with DIR made absolute; an item without ``=`` goes on as given (serve names its fault)."""
    name, sep, directory = item.partition("=")
    return f"{name}={Path(directory).resolve()}" if sep else item


def _into_fleet(args: argparse.Namespace, bundle: Path, model_name: str, version: str, tracking_uri: str) -> int:
    from serving.fleet.fleet import Fleet
    from serving.rollout.registry_console import RegistryConsole

    engine_config_from_args(args)  # validates --kv-memory and friends before anything starts
    console = RegistryConsole(model_name, tracking_uri)
    champion = console.alias_version("champion")
    waive = waived_gates(args.waive)
    installs = champion != version and (champion is None or args.role == "champion")
    waived_cause = check_install(release_verdict(console, version, bundle), version, waive, console, actor()) \
        if installs else ""
    fleet = Fleet(fleet_dir(args), model_name, tracking_uri, backend=args.backend, ray_address=args.ray_address,
                  gateway_port=args.gateway_port, threads=args.threads, kv_memory=args.kv_memory,
                  other_gateways=args.other_gateways)
    _refuse_if_rolling(fleet)
    fleet.connect()
    flags = replica_serve_flags(args)
    if flags:
        print(f"v{version}'s replica serves with: {' '.join(flags)}", flush=True)
    if champion == version:
        replica = fleet.start_replica(bundle, version, serve_flags=flags)
        url = fleet.ensure_gateway(champion=replica)
        print(f"version {version} is already champion; serving it at {url}/v1 (model {model_name!r})")
        return 0
    _warn_about_adapters(fleet, version)
    if installs:
        return _install(fleet, bundle, model_name, version, champion, tracking_uri, flags, waived_cause)
    return _start_rollout(args, fleet, bundle, model_name, version, champion, tracking_uri, flags, console)


def _warn_about_adapters(fleet, version: str) -> None:
    """A new base serves none of the adapters of the old one (an adapter is valid only on the base it was trained
    on): once it is champion, requests for them fail until they are trained on it and deployed again."""
    if not fleet.gateway_alive():
        return
    gateways = fleet.gateways()
    try:
        lanes = sorted(gateways.routing().get("lanes", {}))
    finally:
        gateways.close()
    if lanes:
        print(f"warning: the adapters {', '.join(lanes)} run on the current champion's replicas; v{version} will "
              "not serve them once it is champion: train them on it and `deploy snapshot` them again", flush=True)


def _refuse_if_rolling(fleet) -> None:
    from serving.rollout.state import StateFile

    if fleet.record.rollout_dir and StateFile(fleet.record.rollout_dir).exists():
        state = StateFile(fleet.record.rollout_dir).load()
        if not state.terminal:
            raise ServeError(f"a rollout of v{state.spec.candidate_version} is in progress ({state.phase}); "
                             "`deploy rollback` or `deploy promote` it first")


def _install(fleet, bundle: Path, model_name: str, version: str, champion: str | None, tracking_uri: str,
             flags: list[str], waived_cause: str) -> int:
    from serving.rollout import install_on_fleet

    cause = ("first champion: no champion before, so no canary to compare with" if champion is None
             else f"deployed with --as champion over v{champion} (no rollout)") + waived_cause
    result = install_on_fleet(fleet, model_name=model_name, version=version, bundle=bundle,
                              tracking_uri=tracking_uri, cause=cause, actor=actor(), first=champion is None,
                              serve_flags=flags)
    print(f"v{version} is champion ({cause}); smoke check passed; MLflow run {result['run_id']}")
    print(f"serving {model_name!r} at {result['url']}/v1 (API key for replayed traffic: {fleet.user_key_file})")
    return 0


def _start_rollout(args: argparse.Namespace, fleet, bundle: Path, model_name: str, version: str, champion: str,
                   tracking_uri: str, flags: list[str], console) -> int:
    from serving.deploy.rollout_plan import rollout_plan
    from serving.rollout import start_rollout

    plan = rollout_plan(args, console, version)
    controller = start_rollout(fleet, model_name=model_name, version=version, bundle=bundle, champion=champion,
                               tracking_uri=tracking_uri, plan=plan,
                               start="canary" if args.role == "canary" else "shadow",
                               eval_passed=_eval_passed(bundle), serve_flags=flags,
                               say=lambda line: print(line, flush=True))
    controller.close()
    directory = controller.files.dir
    fleet.record.rollout_dir = str(directory)
    fleet.record.controller_pid = spawn_controller(fleet, directory)
    fleet.save()
    print(f"rollout {controller.state.id}: v{version} against champion v{champion} "
          f"(MLflow run {controller.state.mlflow_run_id}); follow it with `deploy status`")
    if args.wait:
        return follow(directory)
    return 0


def _eval_passed(bundle: Path) -> bool | None:
    from artifacts.errors import EvalRecordError
    from artifacts.eval_record import read_eval_record

    try:
        return read_eval_record(bundle).passed
    except EvalRecordError:
        return None  # the controller asks the registry instead
