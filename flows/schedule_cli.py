"""`lifecycle server`, `lifecycle worker`, `lifecycle schedule`: the lifecycle on a schedule, unattended.

    lifecycle server                                       # a Prefect server with its UI on 127.0.0.1:4200
    lifecycle worker                                       # runs scheduled lifecycle runs (process work pool)
    lifecycle schedule configs/default.yaml --cron "0 3 * * *" [--name nightly]
    lifecycle schedule list | pause NAME | resume NAME | delete NAME

The commands talk to ``$PREFECT_API_URL``, by default the server `lifecycle server` starts. `lifecycle run`
keeps its ephemeral mode: it needs no server.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from artifacts.errors import ConfigError
from flows.environment import prepare_environment, resolve_workdir

ACTIONS = ("list", "pause", "resume", "delete")
DEFAULT_PORT = 4200


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    server = subparsers.add_parser("server", help="start a local Prefect server (with its UI) for scheduled runs")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=DEFAULT_PORT)
    server.set_defaults(func=_server)

    worker = subparsers.add_parser("worker", help="run scheduled lifecycle runs from a process work pool")
    worker.add_argument("--pool", default="lifecycle", help="work pool name (created as a process pool if missing)")
    worker.add_argument("--poll-seconds", type=float, default=10.0, help="how often to ask the server for work")
    worker.set_defaults(func=_worker)

    schedule = subparsers.add_parser(
        "schedule", help="schedule a recipe's lifecycle (RECIPE --cron|--interval), or list|pause|resume|delete",
        description="lifecycle schedule RECIPE (--cron EXPR | --interval 6h) [--name N]; "
                    "lifecycle schedule list | pause NAME | resume NAME | delete NAME")
    schedule.add_argument("target", help="a recipe YAML, or one of: " + ", ".join(ACTIONS))
    schedule.add_argument("name_arg", nargs="?", metavar="NAME", help="the deployment (pause, resume, delete)")
    when = schedule.add_mutually_exclusive_group()
    when.add_argument("--cron", help="cron expression, e.g. '0 3 * * *' (03:00 every day, server time)")
    when.add_argument("--interval", help="every so long: 30s, 15m, 6h, 1d")
    schedule.add_argument("--name", help="deployment name (default: the recipe's name)")
    schedule.add_argument("--pool", default="lifecycle", help="work pool (a process pool here; Docker or "
                          "Kubernetes pools run the same deployment elsewhere)")
    schedule.add_argument("--timeout", default="6h", help="a run's time limit (default 6h)")
    schedule.add_argument("--json", action="store_true", help="list: print JSON")
    schedule.set_defaults(func=_schedule)


def _prefect_env(port: int = DEFAULT_PORT) -> None:
    """Offline, quiet Prefect in the workdir, talking to the local server unless told otherwise."""
    workdir = resolve_workdir()
    prepare_environment(workdir)
    os.environ.setdefault("PREFECT_API_URL", f"http://127.0.0.1:{port}/api")


def _server(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port: must be in 1..65535, got {args.port}")
    workdir = resolve_workdir()
    prepare_environment(workdir)
    env = os.environ | {
        "PREFECT_UI_ENABLED": "true",
        # the UI's browser code calls this address: the port we serve on, not Prefect's default 4200
        "PREFECT_UI_API_URL": f"http://{args.host}:{args.port}/api",
        "PREFECT_SERVER_API_HOST": args.host,
        "PREFECT_SERVER_API_PORT": str(args.port),
        # its own database: `lifecycle run`'s ephemeral server keeps using the default one
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{workdir.prefect_home / 'server.db'}",
        "PREFECT_API_SERVICES_SCHEDULER_LOOP_SECONDS": os.environ.get("PREFECT_API_SERVICES_SCHEDULER_LOOP_SECONDS",
                                                                       "10"),
    }
    env.pop("PREFECT_API_URL", None)
    print(f"Prefect server and UI on http://{args.host}:{args.port} (Ctrl-C stops it); `lifecycle worker` and "
          f"`lifecycle schedule` use it by default", flush=True)
    return subprocess.call([sys.executable, "-m", "prefect", "server", "start", "--host", args.host, "--port",
                            str(args.port)], env=env)


def _worker(args: argparse.Namespace) -> int:
    _prefect_env()
    from flows.schedule import _ensure_pool, _run

    async def ready() -> None:
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            await client.hello()
            await _ensure_pool(client, args.pool)

    _run(ready())
    env = os.environ | {"PREFECT_WORKER_QUERY_SECONDS": str(args.poll_seconds)}
    print(f"worker on pool {args.pool!r} at {os.environ['PREFECT_API_URL']} (Ctrl-C stops it)", flush=True)
    return subprocess.call([sys.executable, "-m", "prefect", "worker", "start", "--pool", args.pool, "--type",
                            "process"], env=env)


def _schedule(args: argparse.Namespace) -> int:
    _prefect_env()
    from flows import schedule

    if args.target in ACTIONS:
        if args.target == "list":
            return _list(schedule.list_schedules(), args.json)
        if not args.name_arg:
            raise ConfigError(f"schedule {args.target}: name the deployment (see `lifecycle schedule list`)")
        if args.target == "delete":
            schedule.delete_schedule(args.name_arg)
        else:
            schedule.set_paused(args.name_arg, args.target == "pause")
        print(f"{args.name_arg}: {args.target}d" if args.target != "pause" else f"{args.name_arg}: paused")
        return 0
    timeout = schedule.parse_interval(args.timeout).total_seconds()
    env = {k: os.environ[k] for k in ("LIFECYCLE_HOME", "MLFLOW_TRACKING_URI", "LIFECYCLE_NOTIFY_WEBHOOK")
           if k in os.environ}
    name = schedule.create_schedule(args.target, name=args.name, cron=args.cron, interval=args.interval,
                                    pool=args.pool, timeout_s=timeout, env=env)
    when = f"cron {args.cron}" if args.cron else f"every {args.interval}"
    print(f"scheduled {name} ({when}) on pool {args.pool!r}; a worker runs it: lifecycle worker --pool {args.pool}")
    return 0


def _list(rows, as_json: bool) -> int:
    if as_json:
        import json
        from dataclasses import asdict

        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="scheduled lifecycles")
    for column in ("deployment", "recipe", "schedule", "paused", "pool", "last run", "next run"):
        table.add_column(column)
    for r in rows:
        table.add_row(r.name, r.recipe, r.schedule, "yes" if r.paused else "no", r.pool, r.last_run, r.next_run)
    Console(width=max(Console().width, 140)).print(table)
    return 0
