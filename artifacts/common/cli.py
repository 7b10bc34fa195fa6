"""How every command line of the project ends: the handler's exit status, or one line and exit 2.

Each package (`lifecycle`, `deploy`, `python -m quantize.cli`, the gateway, the rollout runner) registers its
subcommands on an argparse parser whose handlers are stored in ``func``; running them goes through here, so
a user error (any ``LifecycleError``: bad config, bad bundle, bad flag) is answered the same way everywhere,
as ``error: <cause>`` on stderr and exit status 2, never a traceback; Ctrl-C is exit 130 without one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from artifacts.errors import LifecycleError

__all__ = ["exit_status", "main_with_subcommands", "run_cli"]

Register = Callable[[argparse._SubParsersAction], None]


def exit_status(run: Callable[[], int | None], interrupted: str = "interrupted") -> int:
    """Call ``run`` and turn how it ended into an exit status: its own (None is 0), a user error (any
    ``LifecycleError``) as ``error: <cause>`` on stderr and 2, Ctrl-C as the line ``interrupted`` and 130."""
    try:
        return int(run() or 0)
    except LifecycleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, call the chosen subcommand's ``func`` and map user errors to one line + exit 2."""
    args = parser.parse_args(argv)
    return exit_status(lambda: args.func(args))


def main_with_subcommands(prog: str, register: Register, argv: Sequence[str] | None = None) -> int:
    """The stand-alone entry of one package: a parser named ``prog`` with only that package's subcommands."""
    parser = argparse.ArgumentParser(prog=prog)
    register(parser.add_subparsers(dest="command", required=True))
    return run_cli(parser, argv)
