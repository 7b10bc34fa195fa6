"""`deploy promote | rollback | pause | resume | stop`, and the rollout controller behind them.

A person's request reaches the controller the way the MLflow UI's does: as the ``rollout.action`` (or
``rollout.waive``) tag on the candidate's version. The controller runs in the background as a Prefect flow
(``lifecycle rollout run DIR``); a request finds it restarted when it is not running, and ``follow`` prints
its decisions as they happen.
"""

from __future__ import annotations

import argparse
import getpass
import os
import subprocess
import sys
import time
from pathlib import Path

from artifacts.common.workdir import resolve_workdir
from serving.cli import ServeError
from serving.deploy.release_gates import waived_gates


def fleet_dir(args: argparse.Namespace) -> Path:
    return Path(args.fleet) if args.fleet else resolve_workdir().fleet


def rollout_state(record, adapter: str | None = None):
    """The fleet's rollout (or ``adapter``'s) in progress or last run, None before the first."""
    from serving.rollout.state import StateFile

    directory = record.adapter_rollouts.get(adapter) if adapter else record.rollout_dir
    if directory and StateFile(directory).exists():
        return StateFile(directory).load()
    return None


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
    from serving.rollout.state import AWAITING_APPROVAL, PAUSED, StateFile, phase_exit_status

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
            return phase_exit_status(state.phase)
        if state.phase in (PAUSED, AWAITING_APPROVAL):
            print(f"rollout {state.phase}: {state.reason}\n  decide in the MLflow UI (move `champion` to "
                  f"v{state.spec.candidate_version}, or tag it rollout.action = promote | rollback | resume) or "
                  "with `deploy promote|rollback|resume" + (f" --adapter {state.spec.lane}" if state.spec.lane else "")
                  + "`")
            return phase_exit_status(state.phase)
        time.sleep(poll_s)


def deploy_action(args: argparse.Namespace) -> int:
    from serving.fleet.fleet import Fleet
    from serving.fleet.replica_backend import pid_alive
    from serving.rollout.registry_console import RegistryConsole
    from serving.rollout.state import StateFile

    root = fleet_dir(args)
    record = Fleet.read(root)
    adapter = getattr(args, "adapter", None)
    state = rollout_state(record, adapter)
    if state is None or state.terminal:
        what = f"no rollout of the adapter {adapter!r}" if adapter else "no rollout"
        raise ServeError(f"{root}: {what} in progress to {args.action}")
    rollout_dir = record.adapter_rollouts[adapter] if adapter else record.rollout_dir
    controller_pid = record.adapter_controllers.get(adapter) if adapter else record.controller_pid
    spec = state.spec
    console = RegistryConsole(spec.model_name, spec.tracking_uri)
    waive = waived_gates(getattr(args, "waive", None))
    if waive:
        from serving.rollout.analysis import known_gates

        gates = known_gates(spec.plan)
        unknown = [g for g in waive if g not in gates]
        if unknown:
            raise ServeError(f"--waive: no gate named {unknown[0]!r} (gates: {', '.join(sorted(gates))})")
        console.request_waive(spec.candidate_version, waive, actor())  # a waiver resumes a pause by itself
    else:
        console.request_action(spec.candidate_version, args.action, actor())
    fleet = Fleet(root, record.model_name, record.tracking_uri)
    if not pid_alive(controller_pid):  # the controller died (or was never started): resume it
        pid = spawn_controller(fleet, Path(rollout_dir))
        if adapter:
            fleet.record.adapter_controllers[adapter] = pid
        else:
            fleet.record.controller_pid = pid
        fleet.save()
        print("the rollout controller was not running; restarted it (it resumes from its saved state)")
    before = len(state.decisions)
    deadline = time.monotonic() + args.wait
    files = StateFile(rollout_dir)
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
    from serving.fleet.fleet import Fleet

    root = fleet_dir(args)
    record = Fleet.read(root)
    problems = Fleet(root, record.model_name, record.tracking_uri).stop_all()
    for problem in problems:
        print(f"not stopped: {problem}", file=sys.stderr)
    where = f" (and its replicas on the Ray cluster at {record.ray_address})" if record.backend == "ray" else ""
    print(f"stopped the fleet in {root}{where}" if not problems else f"stopped the rest of the fleet in {root}; "
          "`deploy stop` again once the cluster answers")
    return 1 if problems else 0


def actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user} (deploy CLI)"
