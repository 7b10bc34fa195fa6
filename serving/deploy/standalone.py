"""`deploy snapshot SOURCE --standalone`: one verified snapshot served alone in the foreground on ``--port``,
without the fleet's gateway or a rollout; a registry version is tagged with where and since when it serves."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

from serving.cli import ServeError, engine_config_from_args


def serve_standalone(args: argparse.Namespace, bundle: Path, name: str, registry_uri: str | None,
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
