"""The `deploy` command line: its parser, and the verb each subcommand runs."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from artifacts.common.cli import run_cli
from serving.cli import add_serve_arguments
from serving.deploy.control import deploy_action, deploy_stop
from serving.deploy.snapshot import deploy_snapshot
from serving.deploy.status import deploy_status

ROLES = ("shadow", "canary", "champion")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deploy", description="Put verified model snapshots in front of traffic.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    snapshot = commands.add_parser("snapshot", help="put a bundle or registry version into the fleet")
    add_serve_arguments(snapshot)
    for action in snapshot._actions:  # the serve parser's positional is the snapshot here
        if action.dest == "model":
            action.metavar = "SOURCE"
            action.help = ("bundle or adapter bundle directory, or models:/NAME@ALIAS, or models:/NAME/VERSION (an "
                           "adapter is loaded into the base's replicas and rolled out in its own lane)")
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
    snapshot.add_argument("--waive", default=None, metavar="GATE[,GATE]",
                          help="gates this snapshot goes past, recorded with your name: eval_record installs a "
                               "release that failed its gates; a rollout takes any of its plan's gates")
    snapshot.add_argument("--backend", choices=("local", "ray"), default=None,
                          help="where a new fleet's replicas run: local (processes on this machine; the default) or "
                               "ray (actors on the Ray cluster at --ray-address); an existing fleet keeps its own")
    snapshot.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                          help="the Ray cluster of --backend ray (default: $RAY_ADDRESS, else auto: the cluster "
                               "`ray start` began on this machine)")
    snapshot.add_argument("--gateway", dest="other_gateways", action="append", default=[], metavar="URL",
                          help="another gateway in front of this fleet (run with `lifecycle gateway` on the fleet's "
                               "keys.json): every routing change goes to it too, and rollouts read its evidence; "
                               "repeat for more")
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
        cmd.add_argument("--adapter", default=None, metavar="NAME",
                         help="act on this adapter's rollout (its public name) instead of the base's")
        if action == "resume":
            cmd.add_argument("--waive", default=None, metavar="GATE[,GATE]",
                             help="go on past these inconclusive or advisory gates (recorded with your name; "
                                  "a failed critical gate cannot be waived: use promote)")
        cmd.set_defaults(func=deploy_action, action=action)

    stop = commands.add_parser("stop", help="stop the fleet (gateway, replicas or their Ray actors, controller)")
    _common(stop)
    stop.set_defaults(func=deploy_stop)
    return parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", default=None, help="fleet directory (default: <workdir>/fleet)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI "
                   "or the pipeline's store under $LIFECYCLE_HOME)")
    p.add_argument("--gateway-port", type=int, default=None, help="port of a new fleet's gateway (default: free)")


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv)
