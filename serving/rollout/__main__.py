"""``python -m serving.rollout run DIR``: drive the rollout persisted in DIR to its end, without Prefect.

The orchestrated way is ``lifecycle rollout run DIR`` (the same loop as a Prefect flow); this entry is for
hosts without the pipeline's stack and for the crash drills. Exit status: 0 promoted, 3 rolled back,
4 paused or waiting for a person when ``--until-terminal`` is not given, 2 a user error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from artifacts.errors import LifecycleError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.rollout")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) the rollout in DIR until it ends")
    run.add_argument("dir")
    run.add_argument("--max-seconds", type=float, default=None, help="give up waiting after this long")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from serving.rollout.controller import Controller

    try:
        controller = Controller(args.dir, say=lambda line: print(line, flush=True))
        state = controller.run_until_done(args.max_seconds)
    except LifecycleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return exit_status(state.phase)


def exit_status(phase: str) -> int:
    return {"promoted": 0, "rolled_back": 3}.get(phase, 4)


if __name__ == "__main__":
    sys.exit(main())
