"""`lifecycle run RECIPE` and `lifecycle ui`: the pipeline's own subcommands."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from artifacts.common.workdir import resolve_tracking_uri
from flows.environment import prepare_environment, resolve_workdir


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("run", help="run the lifecycle flow on a recipe (finished stages come from cache)")
    run.add_argument("recipe", help="YAML recipe, e.g. configs/default.yaml")
    run.add_argument("--json-out", help="also write the run summary (stages, eval metrics, cache hits) here")
    run.set_defaults(func=_run)

    ui = subparsers.add_parser("ui", help="start the MLflow UI on the pipeline's tracking store")
    ui.add_argument("--recipe", help="recipe whose workdir to use (default: $LIFECYCLE_HOME or ./.lifecycle)")
    ui.add_argument("--port", type=int, default=5000)
    ui.set_defaults(func=_ui)


def _run(args: argparse.Namespace) -> int:
    from flows.run_stop import RunStop, StopRequested, resume_command

    with RunStop(resume_command(args.recipe, args.json_out)) as stop:
        try:
            return _run_flow(args)
        except StopRequested as request:
            return stop.finish(request)


def _run_flow(args: argparse.Namespace) -> int:
    from flows.preflight import preflight
    from flows.recipe import load_recipe, untuned_keys

    recipe = load_recipe(args.recipe)  # validate before paying for Prefect's start-up
    preflight(recipe, args.recipe)
    for line in untuned_keys(args.recipe):  # a recipe that runs: a refused one gets its one error line only
        print(f"warning: {line}", file=sys.stderr, flush=True)
    workdir = resolve_workdir(recipe.workdir)
    prepare_environment(workdir)
    from flows import quiet_logs
    from flows.lifecycle import lifecycle

    quiet_logs.install()

    started = time.perf_counter()
    result = lifecycle(recipe_path=str(Path(args.recipe).resolve()))
    _print_summary(result, time.perf_counter() - started)
    if args.json_out:
        import json

        Path(args.json_out).write_text(json.dumps(result, indent=2, default=str))
    return 0


def _ui(args: argparse.Namespace) -> int:
    """Run `mlflow ui` until it exits or this command is stopped; either way none of its processes outlive it."""
    from artifacts.common.process_group import terminate_group
    from flows.recipe import load_recipe
    from flows.stop_signals import StopRequested, StopSignals

    workdir = resolve_workdir(load_recipe(args.recipe).workdir if args.recipe else None)
    prepare_environment(workdir)
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", resolve_tracking_uri(workdir=workdir),
               "--host", "127.0.0.1", "--port", str(args.port)]
    print("MLflow UI on http://127.0.0.1:%d (Ctrl-C to stop)" % args.port, flush=True)
    with StopSignals():
        try:
            # its own session: its uvicorn workers form one group with it, and a terminal's Ctrl-C reaches
            # them only through us
            server = subprocess.Popen(command, env=os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                                      start_new_session=True)
            try:
                return server.wait()
            finally:
                terminate_group(server)
        except StopRequested as request:
            return request.exit_status


def _print_summary(result: dict, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    from flows.report import HEADLINE_METRICS, SHORT_TITLES, SLICED_METRIC, slice_table

    console = Console(width=max(Console().width, 110))
    table = Table(title=f"{result['recipe']}: eval results", show_lines=False)
    table.add_column("model")
    for metric in HEADLINE_METRICS:
        table.add_column(SHORT_TITLES[metric], justify="right")
    for label, metrics in result["evals"].items():
        table.add_row(label, *[_fmt(metrics.get(m)) for m in HEADLINE_METRICS])
    console.print(table)
    columns, rows = slice_table(result["evals"])
    if columns:
        sliced = Table(title=f"{SLICED_METRIC} by slice (greedy)")
        sliced.add_column("model")
        for column in columns:
            sliced.add_column(column, justify="right")
        for label, cells in rows:
            sliced.add_row(label, *cells)
        console.print(sliced)
    stages = Table(title="stages")
    for column in ("stage", "seconds", "cached", "output"):
        stages.add_column(column)
    for name, info in result["stages"].items():
        stages.add_row(name, f"{info['seconds']:.1f}", "yes" if info.get("cached") else "no", str(info.get("path", "")))
    console.print(stages)
    for note in result.get("notes", []):
        console.print(f"• {note}")
    console.print(f"finished in {seconds:.1f} s (MLflow run {result['mlflow_run_id']})")
    console.print(f"open the MLflow UI:  lifecycle ui    (or: mlflow ui --backend-store-uri {result['tracking_uri']})")


def _fmt(value: float | None) -> str:
    return "–" if value is None else (f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}")
