"""`deploy status`: what the fleet serves (variants, versions, replicas, traffic shares; each adapter's lane) and
where the rollout stands (phase, the last analysis's gates, waivers, the latest decisions), as tables or as JSON."""

from __future__ import annotations

import argparse
import json
import time

from artifacts.errors import LifecycleError
from serving.deploy.control import fleet_dir, rollout_state


def deploy_status(args: argparse.Namespace) -> int:
    from serving.fleet.fleet import Fleet
    from serving.fleet.gateway_client import GatewayAdmin
    from serving.fleet.replica_backend import pid_alive

    root = fleet_dir(args)
    record = Fleet.read(root)
    routing = None
    if pid_alive(record.gateway_pid):
        gateway = GatewayAdmin(record.gateway_url, (root / "admin.key").read_text().strip())
        try:
            routing = gateway.routing()
        except LifecycleError:
            routing = None
        finally:
            gateway.close()
    state = rollout_state(record)
    status = {"model": record.model_name, "gateway": record.gateway_url if routing else None,
              "other_gateways": record.other_gateways,
              "backend": record.backend + (f" at {record.ray_address}" if record.backend == "ray" else ""),
              "variants": _variants(routing), "adapters": adapter_rows(routing),
              "rollout": _rollout_summary(state, pid_alive(record.controller_pid)),
              "adapter_rollouts": {name: _rollout_summary(rollout_state(record, name),
                                                          pid_alive(record.adapter_controllers.get(name)))
                                   for name in sorted(record.adapter_rollouts)}}
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
    weights = _shares(routing["canary_weight"], canary_on,
                      canary_on and bool((routing.get("baseline") or {}).get("replicas")))
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


def _shares(canary_weight: float, canary_on: bool, baseline_on: bool) -> dict[str, float | None]:
    """Each variant's percent of conversations, as the gateway splits them (the shadow takes none: it mirrors)."""
    canary = canary_weight if canary_on else 0.0
    baseline = min(canary, 100 - canary) if baseline_on else 0.0
    return {"champion": 100 - canary - baseline, "canary": canary, "baseline": baseline, "shadow": None}


def adapter_rows(routing: dict | None) -> list[dict]:
    """One row per adapter lane: the adapter version each variant serves inside the champion's replicas, with
    the canary's share of the adapter's conversations and the share mirrored to its shadow."""
    rows = []
    for public, lane in sorted(((routing or {}).get("lanes") or {}).items()):
        canary_on = bool(lane["canary"]["served_model"])
        weights = _shares(lane["canary_weight"], canary_on, canary_on and bool(lane["baseline"]["served_model"]))
        for name in ("champion", "canary", "baseline", "shadow"):
            variant = lane[name]
            if variant["served_model"]:
                rows.append({"adapter": public, "variant": name, "version": variant["version"],
                             "served_as": variant["served_model"], "weight": weights[name],
                             "mirrored": lane["shadow_fraction"] if name == "shadow" else None})
    return rows


def _rollout_summary(state, controller_alive: bool) -> dict | None:
    if state is None:
        return None
    last = state.analyses[-1] if state.analyses else None
    return {"id": state.id, "candidate": state.spec.candidate_version, "champion": state.spec.champion_version,
            "phase": state.phase, "weight": state.weight, "reason": state.reason,
            # a transition under way (routing moved, aliases or the record not yet): what the routing above may show
            "moving_to": state.pending.to_phase if state.pending is not None else None,
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
    table = Table(title=f"{status['model']} behind {status['gateway'] or '(gateway not running)'}"
                        + "".join(f", {url}" for url in status["other_gateways"]) + f" (replicas: {status['backend']})")
    for column in ("variant", "version", "replicas (healthy)", "traffic"):
        table.add_column(column)
    for row in status["variants"]:
        traffic = f"{row['weight']:g}%" if row["weight"] is not None else f"mirror {row['mirrored']:.0%}"
        name = row["variant"] + (" (champion's snapshot, judged against the canary)" if row["variant"] == "baseline"
                                 else "")
        table.add_row(name, f"v{row['version']}", f"{row['replicas']} ({row['healthy']})", traffic)
    console.print(table)
    if status["adapters"]:
        adapters = Table(title="adapters, served inside the champion's replicas")
        for column in ("adapter", "variant", "version", "served as", "traffic"):
            adapters.add_column(column)
        for row in status["adapters"]:
            traffic = f"{row['weight']:g}%" if row["weight"] is not None else f"mirror {row['mirrored']:.0%}"
            adapters.add_row(row["adapter"], row["variant"], f"v{row['version']}", row["served_as"], traffic)
        console.print(adapters)
        for name, rollout in status["adapter_rollouts"].items():
            if rollout is not None:
                console.print(f"  rollout of {name}: v{rollout['candidate']} vs champion v{rollout['champion']} — "
                              f"[bold]{rollout['phase']}[/]" + (f" at {rollout['weight']:g}%" if rollout["weight"]
                                                               else "")
                              + (f": {rollout['reason']}" if rollout["reason"] else ""), highlight=False)
    rollout = status["rollout"]
    if rollout is None:
        console.print("no rollout yet")
        return
    console.print(f"rollout {rollout['id']}: v{rollout['candidate']} vs champion v{rollout['champion']} — "
                  f"[bold]{rollout['phase']}[/]" + (f" at {rollout['weight']:g}%" if rollout["weight"] else "")
                  + (f" → {rollout['moving_to']} (under way)" if rollout["moving_to"] else "")
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
