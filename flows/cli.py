"""`lifecycle` command line: run the pipeline, inspect bundles, serve a model.

Every user-caused failure derives from `LifecycleError`; this is the one place that turns such an
error into a single `error: ...` line and exit status 2, so nobody gets a traceback as an answer.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from artifacts.common.cli import run_cli

# Packages that contribute subcommands through `register_cli(subparsers)`; imported lazily so that
# `lifecycle --help` does not pay for torch/transformers imports.
_SUBCOMMAND_PROVIDERS = ("flows.run_cli", "artifacts.cli", "evals.cli", "quantize.cli", "serving.cli",
                         "serving.gateway.cli", "flows.rollout_cli", "flows.schedule_cli", "training.draft_cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lifecycle",
        description="Carry a causal LM from base model to production traffic: "
        "train → quantize → bundle → evaluate → serve.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _SUBCOMMAND_PROVIDERS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register_cli(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
