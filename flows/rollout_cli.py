"""`lifecycle rollout run DIR`: drive (or resume) a persisted rollout to its end as a Prefect flow."""

from __future__ import annotations

import argparse

from flows.environment import prepare_environment, resolve_workdir


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    rollout = subparsers.add_parser("rollout", help="run or resume a rollout (what `deploy snapshot` starts)")
    sub = rollout.add_subparsers(dest="rollout_command", required=True, metavar="run")
    run = sub.add_parser("run", help="drive the rollout in DIR until it is promoted or rolled back")
    run.add_argument("dir", help="a rollout directory (<fleet>/rollouts/<id>)")
    run.add_argument("--max-seconds", type=float, default=None, help="stop waiting after this long")
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from serving.rollout.resumable import why_not_resumable
    from serving.rollout.state import RolloutError, StateFile, phase_exit_status

    state = StateFile(args.dir).load()  # a bad directory, or a fleet that is gone, answers one line before Prefect
    why = why_not_resumable(args.dir, state)
    if why:
        raise RolloutError(why)
    prepare_environment(resolve_workdir())
    from flows import quiet_logs
    from flows.rollout import rollout_flow

    quiet_logs.install()
    result = rollout_flow(rollout_dir=str(args.dir), max_seconds=args.max_seconds)
    print(f"rollout {state.id}: {result['phase']}" + (f" ({result['reason']})" if result["reason"] else ""))
    return phase_exit_status(result["phase"])
