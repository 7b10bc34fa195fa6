"""What does a change to the SFT data do? One SFT run of a recipe from a base model, on data built with some keys
changed, scored on its own held-out set.

A data key (``data.sft_json_per_task``, ``data.sft_safety_repeats``) changes what every later stage starts from,
and a whole chain (``grpo_seeds.py``) takes ~14 minutes on 2 cores; SFT alone, ~4. Run one trial per setting,
each a process of its own, the control included (the same seed reproduces the same SFT model on one host):

    LIFECYCLE_TORCH_THREADS=2 .venv/bin/python benchmarks/sft_trial.py configs/default.yaml BASE_DIR /tmp/t0
    LIFECYCLE_TORCH_THREADS=2 .venv/bin/python benchmarks/sft_trial.py configs/default.yaml BASE_DIR /tmp/t1 \\
        --data sft_json_per_task=200

It prints one line: the settings, the SFT seconds, and task accuracy, refusals, over-refusals and the three
``structured`` numbers (valid JSON unconstrained, valid and right under the grammar).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from artifacts.errors import LifecycleError  # noqa: E402
from benchmarks.grpo_repeat import one_line_exit, override  # noqa: E402
from evals.config import EvalConfig  # noqa: E402
from evals.results import metrics_dict  # noqa: E402
from evals.runner import run_evals  # noqa: E402
from flows.recipe import load_recipe  # noqa: E402
from training.data import build_datasets  # noqa: E402
from training.sft import run_sft  # noqa: E402

SHOWN = ("task_accuracy", "refusal_rate", "over_refusal_rate", "json_schema_adherence", "constrained_validity",
         "constrained_task_accuracy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("base_model", type=Path, help="the base model dir (make run's models/base/<key>)")
    parser.add_argument("workdir", type=Path, help="a new directory: the data and the SFT stage go here")
    parser.add_argument("--data", type=override, action="append", default=[], metavar="KEY=VALUE",
                        help="a data key changed from the recipe's (repeatable)")
    parser.add_argument("--set", dest="sft", type=override, action="append", default=[], metavar="KEY=VALUE",
                        help="an SFT stage key changed from the recipe's (repeatable)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    if not (args.base_model / "config.json").is_file():
        raise LifecycleError(f"{args.base_model}: not a model directory (no config.json)")
    data = build_datasets(dataclasses.replace(recipe.data, **dict(args.data)), args.workdir / "data").path
    started = time.perf_counter()
    model = run_sft(dataclasses.replace(recipe.training.sft, **dict(args.sft)), args.base_model, data,
                    args.workdir / "sft").output_dir
    seconds = time.perf_counter() - started
    config = EvalConfig(suites=["task_accuracy", "safety", "structured"], max_new_tokens=recipe.evals.max_new_tokens,
                        batch_size=recipe.evals.batch_size)
    metrics = metrics_dict(run_evals(model, data, config))
    settings = " ".join(f"{k}={v}" for k, v in [*args.data, *args.sft]) or "the recipe"
    print(f"{settings}: SFT {seconds:.0f} s; " + ", ".join(f"{m} {metrics[m]:.3f}" for m in SHOWN))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return one_line_exit(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
