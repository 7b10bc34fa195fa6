"""``python -m serving.rollout run DIR``: drive the rollout persisted in DIR to its end, without Prefect.

The orchestrated way is ``lifecycle rollout run DIR`` (the same loop as a Prefect flow); this entry is for
hosts without the pipeline's stack and for the crash drills. It ticks until the rollout is promoted or rolled
back; a paused rollout, or one waiting for approval, keeps polling for a person's decision, until
``--max-seconds`` (when given) runs out. Exit status: 0 promoted, 3 rolled back, 4 not finished when
``--max-seconds`` ran out (still running, paused or waiting for a person), 2 a user error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from artifacts.common.cli import main_with_subcommands


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return main_with_subcommands("python -m serving.rollout", _register, argv)


def _register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="run (or resume) the rollout in DIR until it ends")
    run.add_argument("dir")
    run.add_argument("--max-seconds", type=float, default=None, help="give up waiting after this long")
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from serving.rollout.controller import Controller
    from serving.rollout.resumable import why_not_resumable
    from serving.rollout.state import RolloutError, StateFile, phase_exit_status

    why = why_not_resumable(args.dir, StateFile(args.dir).load())
    if why:
        raise RolloutError(why)
    controller = Controller(args.dir, say=lambda line: print(line, flush=True))
    return phase_exit_status(controller.run_until_done(args.max_seconds).phase)


if __name__ == "__main__":
    sys.exit(main())
