"""`lifecycle gateway CONFIG` (start the gateway alone) and `lifecycle gateway-keys ...` (manage API keys).

Runs without torch: the gateway is a separate process in front of engine replicas, so it starts in a
second and never competes with them for the model stack's memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from artifacts.common.cli import main_with_subcommands


def register_cli(subparsers) -> None:
    gateway = subparsers.add_parser("gateway", help="start the OpenAI-compatible gateway in front of engine replicas")
    gateway.add_argument("config", help="gateway YAML (see configs/gateway.example.yaml)")
    gateway.add_argument("--host", default=None, help="override the config's host")
    gateway.add_argument("--port", type=int, default=None, help="override the config's port")
    gateway.set_defaults(func=cmd_gateway)
    keys = subparsers.add_parser("gateway-keys", help="create, list or revoke the gateway's API keys (stored hashed)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="add|list|revoke")
    add = keys_sub.add_parser("add", help="create a key and print it once")
    add.add_argument("name")
    add.add_argument("--keys-file", required=True)
    add.add_argument("--admin", action="store_true", help="the key may use the admin API")
    add.add_argument("--rpm", type=float, default=None, help="requests per minute (default: the gateway's)")
    add.add_argument("--tpm", type=float, default=None, help="tokens per minute (default: the gateway's)")
    add.set_defaults(func=cmd_keys_add)
    listing = keys_sub.add_parser("list", help="list key names and limits")
    listing.add_argument("--keys-file", required=True)
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys_sub.add_parser("revoke", help="remove a key")
    revoke.add_argument("name")
    revoke.add_argument("--keys-file", required=True)
    revoke.set_defaults(func=cmd_keys_revoke)


def cmd_gateway(args: argparse.Namespace) -> int:
    from serving.gateway.config import load_gateway_config

    config = load_gateway_config(args.config)
    if args.host:
        config.host = args.host
    if args.port:
        config.port = args.port
    run_gateway(config)
    return 0


def run_gateway(config) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn closes open streams on the way out)."""
    import logging

    import uvicorn

    from serving.gateway.app import build_gateway_app

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call would bury ours
    configure_access_log(config)
    app = build_gateway_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)


def configure_access_log(config) -> None:
    """Per-request lines go to ``state_dir/access.log``, rotated at ``access_log.max_bytes`` with
    ``access_log.backups`` old files kept, and never to the process log (warnings stay there)."""
    import logging
    from logging.handlers import RotatingFileHandler

    access = logging.getLogger("serving.gateway.access")
    access.propagate = False
    for handler in list(access.handlers):
        access.removeHandler(handler)
        handler.close()
    settings = config.access_log
    if not settings.enabled:
        access.addHandler(logging.NullHandler())
        return
    config.state_path.mkdir(parents=True, exist_ok=True)
    handler = RotatingFileHandler(config.state_path / "access.log", maxBytes=settings.max_bytes,
                                  backupCount=settings.backups, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)  # its own switch is `enabled`, not the process's log_level


def _store(path: str, create: bool):
    from serving.gateway.keys import KeyStore

    if create and not Path(path).exists():
        return KeyStore([])
    return KeyStore.load(path)


def cmd_keys_add(args: argparse.Namespace) -> int:
    store = _store(args.keys_file, create=True)
    secret = store.add(args.name, admin=args.admin, requests_per_minute=args.rpm, tokens_per_minute=args.tpm)
    store.save(args.keys_file)
    print(secret)
    print(f"key {args.name!r} added to {args.keys_file}; the secret above is shown only once", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    for key in _store(args.keys_file, create=False).keys:
        limits = f"rpm {key.requests_per_minute or 'default'}, tpm {key.tokens_per_minute or 'default'}"
        print(f"{key.name}\t{'admin' if key.admin else 'user'}\t{limits}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    store = _store(args.keys_file, create=False)
    store.revoke(args.name)
    store.save(args.keys_file)
    print(f"key {args.name!r} revoked", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m serving.gateway.cli CONFIG`` or ``python -m serving.gateway.cli gateway-keys add ...``."""
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv and argv[0] not in ("gateway", "gateway-keys"):
        argv = ["gateway", *argv]
    return main_with_subcommands("gateway", register_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
