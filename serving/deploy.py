"""`deploy`: put verified snapshots in front of traffic, and steer the rollout by hand.

    deploy snapshot SOURCE [--as shadow|canary|champion]   into the local fleet (gateway + one replica per snapshot)
    deploy status                                          variants, versions, weights, step, gate values, decisions
    deploy promote | rollback | pause | resume            ask the rollout controller, as the MLflow UI tag does
    deploy stop                                            stop the local fleet

SOURCE is a bundle directory or a registry URI (`models:/name@alias`, `models:/name/3`); it is resolved to
a local directory and verified in full before anything serves it. The first snapshot of a model becomes
champion after a smoke check; later ones go through a rollout (shadow with a noise floor, canary steps,
gates) run by the controller in the background (`lifecycle rollout run DIR`, a Prefect flow).
`--standalone` serves one snapshot in the foreground without the fleet, as before.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from artifacts.common.cli import run_cli
from artifacts.common.workdir import resolve_tracking_uri, resolve_workdir
from artifacts.errors import LifecycleError
from serving.cli import ServeError, add_serve_arguments, engine_config_from_args

ROLES = ("shadow", "canary", "champion")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deploy", description="Put verified model snapshots in front of traffic.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    snapshot = commands.add_parser("snapshot", help="put a bundle or registry version into the fleet")
    add_serve_arguments(snapshot)
    for action in snapshot._actions:  # the serve parser's positional is the snapshot here
        if action.dest == "model":
            action.metavar = "SOURCE"
            action.help = "bundle directory, or models:/NAME@ALIAS, or models:/NAME/VERSION"
        if action.dest == "kv_memory":
            action.default = "128MiB"
    snapshot.add_argument("--as", dest="role", choices=ROLES, default=None,
                          help="shadow (default: the full plan from shadow), canary (skip shadow), or champion "
                               "(no rollout: smoke check, then all traffic)")
    snapshot.add_argument("--plan", default=None, help="rollout plan YAML (RolloutPlan fields; default: the built-in)")
    snapshot.add_argument("--probes", default=None, help="data-stage dir whose held-out prompts probe both models")
    snapshot.add_argument("--model-name", default=None, help="registered model name for a bundle dir "
                          "(default: the manifest's name)")
    snapshot.add_argument("--wait", action="store_true", help="follow the rollout here until it ends or waits")
    snapshot.add_argument("--standalone", action="store_true",
                          help="serve this snapshot alone in the foreground on --port (no gateway, no rollout)")
    _common(snapshot)
    snapshot.add_argument("--dest", default=None, help="where registry downloads go (default: <workdir>/deployments)")
    snapshot.add_argument("--dry-run", action="store_true", help="resolve and verify only; do not serve")
    snapshot.set_defaults(func=deploy_snapshot)

    status = commands.add_parser("status", help="what the fleet serves and where the rollout stands")
    _common(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=deploy_status)

    for action, doc in (("promote", "promote the candidate now, skipping the remaining steps"),
                        ("rollback", "roll the candidate back now"), ("pause", "hold traffic where it is"),
                        ("resume", "go on from a pause, or approve the next step")):
        cmd = commands.add_parser(action, help=doc)
        _common(cmd)
        cmd.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the controller to act")
        if action == "resume":
            cmd.add_argument("--waive", default=None, metavar="GATE[,GATE]",
                             help="go on past these inconclusive or advisory gates (recorded with your name; "
                                  "a failed critical gate cannot be waived: use promote)")
        cmd.set_defaults(func=deploy_action, action=action)

    stop = commands.add_parser("stop", help="stop the local fleet (gateway, replicas, controller)")
    _common(stop)
    stop.set_defaults(func=deploy_stop)
    return parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", default=None, help="fleet directory (default: <workdir>/fleet)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI "
                   "or the pipeline's store under $LIFECYCLE_HOME)")
    p.add_argument("--gateway-port", type=int, default=None, help="port of a new fleet's gateway (default: free)")


def _tracking_uri(args: argparse.Namespace) -> str:
    return resolve_tracking_uri(args.tracking_uri)


def _fleet_dir(args: argparse.Namespace) -> Path:
    return Path(args.fleet) if args.fleet else resolve_workdir().fleet


# ----------------------------------------------------------------------------- snapshot
def deploy_snapshot(args: argparse.Namespace) -> int:
    from artifacts.verify import verify_bundle

    tracking_uri = _tracking_uri(args)
    source: str = args.model
    from_registry = source.startswith("models:/")
    if not from_registry and not Path(source).is_dir():
        raise ServeError(f"{source}: neither a bundle directory nor a models:/ URI")
    if not from_registry and not (Path(source) / "manifest.json").is_file():
        raise ServeError(f"{source}: not a bundle (no manifest.json); `lifecycle serve` serves plain model dirs")
    bundle, model_name, version = _resolve(args, source, tracking_uri)
    manifest = verify_bundle(bundle)
    quant = manifest.quantization.method if manifest.quantization else "none"
    print(f"verified {manifest.name} {manifest.version} ({quant}) at {bundle}"
          + (f" = models:/{model_name}/{version}" if version else ""), flush=True)
    if args.dry_run:
        return 0
    if args.standalone:
        return _serve_standalone(args, bundle, manifest.name, source if from_registry else None, tracking_uri)
    return _into_fleet(args, bundle, model_name, version, tracking_uri)


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


def _serve_standalone(args: argparse.Namespace, bundle: Path, name: str, registry_uri: str | None,
                      tracking_uri: str) -> int:
    engine_config = engine_config_from_args(args)
    if registry_uri:
        _record_deployment(registry_uri, tracking_uri, f"http://{args.host}:{args.port}")
    _check_port_free(args.host, args.port)
    from serving.api.server import run_server

    run_server(bundle, args.host, args.port, engine_config, served_model_name=args.served_model_name or name,
               drain_timeout_s=args.drain_timeout, log_level=args.log_level, engine_process=args.engine_process,
               verify=False)  # verified above, once: hashing a multi-GB bundle twice buys nothing
    return 0


# serve flags the fleet sets itself on every replica: the rest of what `deploy snapshot` was given goes on to
# the snapshot's replica (see replica_serve_flags)
_FLEET_OWNED = frozenset({"model", "host", "port", "served_model_name", "kv_memory", "threads", "log_level"})
_PATH_VALUED = frozenset({"speculative_model"})


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
        else:
            text = str(Path(value).resolve()) if action.dest in _PATH_VALUED else str(value)
            flags += [action.option_strings[0], text]
    return flags


def _into_fleet(args: argparse.Namespace, bundle: Path, model_name: str, version: str, tracking_uri: str) -> int:
    from serving.rollout.fleet import LocalFleet
    from serving.rollout.registry_console import RegistryConsole

    engine_config_from_args(args)  # validates --kv-memory and friends before anything starts
    fleet = LocalFleet(_fleet_dir(args), model_name, tracking_uri, gateway_port=args.gateway_port,
                       threads=args.threads, kv_memory=args.kv_memory)
    _refuse_if_rolling(fleet)
    flags = replica_serve_flags(args)
    if flags:
        print(f"v{version}'s replica serves with: {' '.join(flags)}", flush=True)
    console = RegistryConsole(model_name, tracking_uri)
    champion = console.alias_version("champion")
    if champion == version:
        replica = fleet.start_replica(bundle, version, serve_flags=flags)
        url = _ensure_routed_champion(fleet, replica)
        print(f"version {version} is already champion; serving it at {url}/v1 (model {model_name!r})")
        return 0
    if champion is None or args.role == "champion":
        return _install(fleet, bundle, model_name, version, champion, tracking_uri, flags)
    return _start_rollout(args, fleet, bundle, model_name, version, champion, tracking_uri, flags)


def _refuse_if_rolling(fleet) -> None:
    from serving.rollout.state import StateFile

    if fleet.record.rollout_dir and StateFile(fleet.record.rollout_dir).exists():
        state = StateFile(fleet.record.rollout_dir).load()
        if not state.terminal:
            raise ServeError(f"a rollout of v{state.spec.candidate_version} is in progress ({state.phase}); "
                             "`deploy rollback` or `deploy promote` it first")


def _ensure_routed_champion(fleet, replica) -> str:
    return fleet.ensure_gateway(champion=replica)


def _install(fleet, bundle: Path, model_name: str, version: str, champion: str | None, tracking_uri: str,
             flags: list[str]) -> int:
    from serving.rollout.install import install_champion

    replica = fleet.start_replica(bundle, version, serve_flags=flags)
    url = fleet.ensure_gateway(champion=replica if champion is None else None)
    cause = ("first champion: no champion before, so no canary to compare with" if champion is None
             else f"deployed with --as champion over v{champion} (no rollout)")
    result = install_champion(model_name=model_name, version=version, replica_url=replica.url,
                              served_model=replica.served_model, gateway_url=url, admin_key=fleet.admin_key(),
                              tracking_uri=tracking_uri, cause=cause, actor=_actor())
    from serving.rollout.gateway_client import GatewayAdmin

    gateway = GatewayAdmin(url, fleet.admin_key())
    try:
        fleet.retire_unrouted(gateway.routing())
    finally:
        gateway.close()
    print(f"v{version} is champion ({cause}); smoke check passed; MLflow run {result['run_id']}")
    print(f"serving {model_name!r} at {url}/v1 (API key for replayed traffic: {fleet.user_key_file})")
    return 0


def _start_rollout(args: argparse.Namespace, fleet, bundle: Path, model_name: str, version: str, champion: str,
                   tracking_uri: str, flags: list[str]) -> int:
    from artifacts.registry import resolve_bundle
    from serving.rollout.controller import Controller
    from serving.rollout.state import RolloutSpec

    champion_replica = fleet.replica(champion)
    if champion_replica is None:
        champion_bundle = resolve_bundle(f"models:/{model_name}/{champion}", resolve_workdir().deployments,
                                         tracking_uri=tracking_uri)
        champion_replica = fleet.start_replica(champion_bundle, champion)
    url = _ensure_routed_champion(fleet, champion_replica)
    candidate, baseline = fleet.start_rollout_replicas(bundle, version, champion_replica, serve_flags=flags)
    print(f"baseline for the canary steps: a fresh replica of v{champion} at {baseline.url}", flush=True)
    plan = _load_plan(args.plan)
    if args.probes:
        plan.probes = replace(plan.probes, data_dir=str(Path(args.probes).resolve()))
    spec = RolloutSpec(model_name=model_name, candidate_version=version, champion_version=champion,
                       candidate_replicas=[candidate.url], champion_replicas=[champion_replica.url],
                       candidate_served_model=candidate.served_model,
                       champion_served_model=champion_replica.served_model, baseline_replicas=[baseline.url],
                       gateway_url=url, admin_key_file=str(fleet.admin_key_file), tracking_uri=tracking_uri,
                       plan=plan, start="canary" if args.role == "canary" else "shadow",
                       eval_passed=_eval_passed(bundle),
                       fleet_dir=str(fleet.root))
    directory = fleet.rollouts / f"v{version}-{time.strftime('%Y%m%d-%H%M%S')}"
    controller = Controller.create(directory, spec, say=lambda line: print(line, flush=True))
    controller.close()
    fleet.record.rollout_dir = str(directory)
    fleet.record.controller_pid = spawn_controller(fleet, directory)
    fleet.save()
    print(f"rollout {controller.state.id}: v{version} against champion v{champion} "
          f"(MLflow run {controller.state.mlflow_run_id}); follow it with `deploy status`")
    if args.wait:
        return follow(directory)
    return 0


def _load_plan(path: str | None):
    from serving.rollout.plan import RolloutPlan

    if not path:
        return RolloutPlan()
    from artifacts.common.config_loader import build_dataclass, read_yaml_mapping

    return build_dataclass(RolloutPlan, read_yaml_mapping(Path(path)), key="", source=path)


def _eval_passed(bundle: Path) -> bool | None:
    from artifacts.errors import EvalRecordError
    from artifacts.eval_record import read_eval_record

    try:
        return read_eval_record(bundle).passed
    except EvalRecordError:
        return None  # the controller asks the registry instead


def spawn_controller(fleet, directory: Path) -> int:
    """Run the rollout in the background as a Prefect flow (`lifecycle rollout run DIR`)."""
    fleet.logs.mkdir(parents=True, exist_ok=True)
    log = fleet.logs / f"controller-{directory.name}.log"
    with open(log, "ab") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "rollout", "run", str(directory)],
                                stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"}, start_new_session=True)
    return proc.pid


def follow(directory: Path, poll_s: float = 1.0) -> int:
    """Print the rollout's decisions as they happen, until it ends or waits for a person."""
    from serving.rollout.report import timeline_lines
    from serving.rollout.state import AWAITING_APPROVAL, PAUSED, StateFile

    files = StateFile(directory)
    shown = 0
    while True:
        state = files.load()
        lines = timeline_lines(state)
        for line in lines[shown:]:
            print(line, flush=True)
        shown = len(lines)
        if state.terminal:
            print(f"rollout {state.phase}" + (f": {state.reason}" if state.reason else ""))
            return 0 if state.phase == "promoted" else 3
        if state.phase in (PAUSED, AWAITING_APPROVAL):
            print(f"rollout {state.phase}: {state.reason}\n  decide in the MLflow UI (move `champion` to "
                  f"v{state.spec.candidate_version}, or tag it rollout.action = promote | rollback | resume) or "
                  "with `deploy promote|rollback|resume`")
            return 4
        time.sleep(poll_s)


# ----------------------------------------------------------------------------- status and actions
def _rollout_state(record):
    from serving.rollout.state import StateFile

    if record.rollout_dir and StateFile(record.rollout_dir).exists():
        return StateFile(record.rollout_dir).load()
    return None


def deploy_status(args: argparse.Namespace) -> int:
    from serving.rollout.fleet import LocalFleet, pid_alive
    from serving.rollout.gateway_client import GatewayAdmin

    root = _fleet_dir(args)
    record = LocalFleet.read(root)
    routing = None
    if pid_alive(record.gateway_pid):
        gateway = GatewayAdmin(record.gateway_url, (root / "admin.key").read_text().strip())
        try:
            routing = gateway.routing()
        except LifecycleError:
            routing = None
        finally:
            gateway.close()
    state = _rollout_state(record)
    status = {"model": record.model_name, "gateway": record.gateway_url if routing else None,
              "variants": _variants(routing), "rollout": _rollout_summary(state, pid_alive(record.controller_pid))}
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return 0
    _print_status(status, state)
    return 0


def _variants(routing: dict | None) -> list[dict]:
    if routing is None:
        return []
    rows = []
    canary_on = bool(routing["canary"]["replicas"])
    baseline_on = canary_on and bool((routing.get("baseline") or {}).get("replicas"))
    canary_weight = routing["canary_weight"] if canary_on else 0.0
    baseline_weight = min(canary_weight, 100 - canary_weight) if baseline_on else 0.0
    weights = {"champion": 100 - canary_weight - baseline_weight, "canary": canary_weight,
               "baseline": baseline_weight, "shadow": None}
    for name in ("champion", "canary", "baseline", "shadow"):
        variant = routing.get(name) or {"replicas": []}
        if not variant["replicas"]:
            continue
        healthy = sum(r["healthy"] for r in routing["replicas"] if r["variant"] == name)
        weight = weights[name]
        rows.append({"variant": name, "version": variant["version"], "replicas": len(variant["replicas"]),
                     "healthy": healthy, "weight": weight,
                     "mirrored": routing["shadow_fraction"] if name == "shadow" else None})
    return rows


def _rollout_summary(state, controller_alive: bool) -> dict | None:
    if state is None:
        return None
    last = state.analyses[-1] if state.analyses else None
    return {"id": state.id, "candidate": state.spec.candidate_version, "champion": state.spec.champion_version,
            "phase": state.phase, "weight": state.weight, "reason": state.reason,
            "controller": "running" if controller_alive else "not running",
            "waivers": state.waivers,
            "last_analysis": None if last is None else {
                "look": last["look"], "summary": last["summary"], "traffic": last.get("traffic", []),
                "advice": last.get("advice", ""), "waived": last.get("waived", []),
                "gates": [{k: v[k] for k in ("gate", "outcome", "candidate", "baseline", "reason")}
                          for v in last["verdicts"]]},
            "last_decision": state.decisions[-1] if state.decisions else None, "mlflow_run": state.mlflow_run_id}


def _print_status(status: dict, state) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"{status['model']} behind {status['gateway'] or '(gateway not running)'}")
    for column in ("variant", "version", "replicas (healthy)", "traffic"):
        table.add_column(column)
    for row in status["variants"]:
        traffic = f"{row['weight']:g}%" if row["weight"] is not None else f"mirror {row['mirrored']:.0%}"
        name = row["variant"] + (" (champion's snapshot, judged against the canary)" if row["variant"] == "baseline"
                                 else "")
        table.add_row(name, f"v{row['version']}", f"{row['replicas']} ({row['healthy']})", traffic)
    console.print(table)
    rollout = status["rollout"]
    if rollout is None:
        console.print("no rollout yet")
        return
    console.print(f"rollout {rollout['id']}: v{rollout['candidate']} vs champion v{rollout['champion']} — "
                  f"[bold]{rollout['phase']}[/]" + (f" at {rollout['weight']:g}%" if rollout["weight"] else "")
                  + f" (controller {rollout['controller']}; MLflow run {rollout['mlflow_run']})", highlight=False)
    if rollout["reason"]:
        console.print(f"  reason: {rollout['reason']}", highlight=False)
    if rollout["last_analysis"]:
        gates = Table(title=f"analysis {rollout['last_analysis']['look']}: {rollout['last_analysis']['summary'][:80]}")
        for column in ("gate", "verdict", "candidate", "baseline", "why"):
            gates.add_column(column)
        waived = set(rollout["last_analysis"]["waived"])
        for g in rollout["last_analysis"]["gates"]:
            verdict = g["outcome"] + (" (waived)" if g["gate"] in waived else "")
            gates.add_row(g["gate"], verdict, _fmt(g["candidate"]), _fmt(g["baseline"]), g["reason"][:70])
        console.print(gates)
        traffic = rollout["last_analysis"]["traffic"]
        if traffic:
            console.print("  traffic in that window: " + ", ".join(
                f"{t['variant']} v{t['version']} {t['requests']} requests from {t['keys']} keys" for t in traffic),
                highlight=False)
        if rollout["last_analysis"]["advice"]:
            console.print(f"  {rollout['last_analysis']['advice']}", highlight=False)
    for gate, waiver in (rollout.get("waivers") or {}).items():
        console.print(f"  waived: {gate} by {waiver['actor']} at "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(waiver['at']))}", highlight=False)
    from serving.rollout.report import timeline_lines

    for line in timeline_lines(state)[-6:]:
        console.print(f"  {line}", highlight=False)


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.3g}"


def deploy_action(args: argparse.Namespace) -> int:
    from serving.rollout.fleet import LocalFleet, pid_alive
    from serving.rollout.registry_console import RegistryConsole
    from serving.rollout.state import StateFile

    root = _fleet_dir(args)
    record = LocalFleet.read(root)
    state = _rollout_state(record)
    if state is None or state.terminal:
        raise ServeError(f"{root}: no rollout in progress to {args.action}")
    spec = state.spec
    console = RegistryConsole(spec.model_name, spec.tracking_uri)
    waive = [g.strip() for g in (getattr(args, "waive", None) or "").split(",") if g.strip()]
    if waive:
        from serving.rollout.analysis import known_gates

        gates = known_gates(spec.plan)
        unknown = [g for g in waive if g not in gates]
        if unknown:
            raise ServeError(f"--waive: no gate named {unknown[0]!r} (gates: {', '.join(sorted(gates))})")
        console.request_waive(spec.candidate_version, waive, _actor())  # a waiver resumes a pause by itself
    else:
        console.request_action(spec.candidate_version, args.action, _actor())
    fleet = LocalFleet(root, record.model_name, record.tracking_uri)
    if not pid_alive(record.controller_pid):  # the controller died (or was never started): resume it
        fleet.record.controller_pid = spawn_controller(fleet, Path(record.rollout_dir))
        fleet.save()
        print("the rollout controller was not running; restarted it (it resumes from its saved state)")
    before = len(state.decisions)
    deadline = time.monotonic() + args.wait
    files = StateFile(record.rollout_dir)
    while time.monotonic() < deadline:
        state = files.load()
        if len(state.decisions) > before:
            from serving.rollout.report import timeline_lines

            for line in timeline_lines(state)[before:]:
                print(line)
            return 0
        time.sleep(0.5)
    print(f"asked for {args.action}; the controller has not acted yet (see `deploy status`)")
    return 0


def deploy_stop(args: argparse.Namespace) -> int:
    from serving.rollout.fleet import LocalFleet

    root = _fleet_dir(args)
    record = LocalFleet.read(root)
    LocalFleet(root, record.model_name, record.tracking_uri).stop_all()
    print(f"stopped the fleet in {root}")
    return 0


# ----------------------------------------------------------------------------- helpers
def _actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user} (deploy CLI)"


def _record_deployment(uri: str, tracking_uri: str, endpoint: str) -> None:
    """Tag the registry version so the MLflow UI shows where and since when it serves."""
    from mlflow import MlflowClient

    from artifacts.registry import get_version

    ref = get_version(uri, tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    client.set_model_version_tag(ref.name, ref.version, "lifecycle.deployed_endpoint", endpoint)
    client.set_model_version_tag(ref.name, ref.version, "lifecycle.deployed_at",
                                 time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ServeError(f"--port: cannot listen on {host}:{port} ({exc.strerror})") from None


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
