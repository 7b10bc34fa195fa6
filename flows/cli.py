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
from artifacts.errors import LifecycleError, one_line

# Packages that contribute subcommands through `register_cli(subparsers)`; imported lazily so that
# `lifecycle --help` does not pay for torch/transformers imports.
_SUBCOMMAND_PROVIDERS = ("flows.run_cli", "artifacts.cli", "evals.cli", "quantize.cli", "serving.cli",
                         "serving.gateway.cli", "flows.rollout_cli", "flows.schedule_cli", "training.draft_cli")


class SubcommandImportError(LifecycleError):
    """A package that contributes subcommands cannot be imported (a broken install or a missing dependency)."""

    def __init__(self, module_name: str, exc: ImportError) -> None:
        self.module_name = module_name
        super().__init__(one_line(f"cannot load the {module_name} subcommands: {type(exc).__name__}: {exc}"))


def build_parser() -> argparse.ArgumentParser:
    """The `lifecycle` parser with every package's subcommands; raises SubcommandImportError if a package
    that provides some cannot be imported (never a parser that silently lacks them)."""
    parser = argparse.ArgumentParser(
        prog="lifecycle",
        description="Carry a causal LM from base model to production traffic: "
        "train → quantize → bundle → evaluate → serve.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _SUBCOMMAND_PROVIDERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise SubcommandImportError(module_name, exc) from exc
        module.register_cli(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except SubcommandImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_cli(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
