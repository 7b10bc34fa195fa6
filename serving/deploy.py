"""`deploy snapshot SOURCE`: roll a frozen bundle out by hand.

SOURCE is a bundle directory or a registry URI (`models:/name@alias`, `models:/name/3`). The bundle is
resolved to a local directory, verified in full (checksums, shapes, tokenizer vs embeddings, chat
template, contracts) and only then served; a snapshot that fails verification is never started.
When SOURCE came from the registry, the model version is tagged with when and where it was deployed,
so the MLflow UI shows what is serving.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from artifacts.errors import LifecycleError
from serving.cli import ServeError, add_serve_arguments, engine_config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deploy", description="Deploy a verified model snapshot by hand.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    snapshot = commands.add_parser("snapshot", help="resolve, verify and serve a bundle or registry version")
    add_serve_arguments(snapshot)
    for action in snapshot._actions:  # the serve parser's positional is the snapshot here
        if action.dest == "model":
            action.metavar = "SOURCE"
            action.help = "bundle directory, or models:/NAME@ALIAS, or models:/NAME/VERSION"
    snapshot.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI "
                          "or the pipeline's store under $LIFECYCLE_HOME)")
    snapshot.add_argument("--dest", default=None, help="where registry downloads go (default: <workdir>/deployments)")
    snapshot.add_argument("--dry-run", action="store_true", help="resolve and verify only; do not serve")
    snapshot.set_defaults(func=deploy_snapshot)
    return parser


def deploy_snapshot(args: argparse.Namespace) -> int:
    from artifacts.registry import resolve_bundle
    from artifacts.verify import verify_bundle
    from flows.environment import resolve_workdir

    workdir = resolve_workdir()
    tracking_uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or workdir.tracking_uri()
    source: str = args.model
    from_registry = source.startswith("models:/")
    if not from_registry and not Path(source).is_dir():
        raise ServeError(f"{source}: neither a bundle directory nor a models:/ URI")
    if not from_registry and not (Path(source) / "manifest.json").is_file():
        raise ServeError(f"{source}: not a bundle (no manifest.json); `lifecycle serve` serves plain model dirs")
    dest = Path(args.dest) if args.dest else workdir.root / "deployments"
    bundle = resolve_bundle(source, dest, tracking_uri=tracking_uri)  # verifies; raises on any disagreement
    manifest = verify_bundle(bundle)
    quant = manifest.quantization.method if manifest.quantization else "none"
    print(f"verified {manifest.name} {manifest.version} ({quant}) at {bundle}", flush=True)
    if args.dry_run:
        return 0
    engine_config = engine_config_from_args(args)
    if from_registry:
        _record_deployment(source, tracking_uri, f"http://{args.host}:{args.port}")
    _check_port_free(args.host, args.port)
    from serving.api.server import run_server

    run_server(bundle, args.host, args.port, engine_config,
               served_model_name=args.served_model_name or manifest.name,
               drain_timeout_s=args.drain_timeout, log_level=args.log_level,
               verify=False)  # verified above, once: hashing a multi-GB bundle twice buys nothing
    return 0


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
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LifecycleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
