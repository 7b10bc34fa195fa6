"""GRPO's gain over its input, repeated over seeds: is the pipeline's one GRPO figure signal or luck?

Runs the recipe's GRPO stage from one input model (the DPO stage's output) once per seed, then scores the
input and every output on the held-out task prompts: greedy accuracy and sampled accuracy (``--k`` draws
per prompt at T 1.0, the server's default; the same draws for every model, see ``evals.generation``).
The table ends with the mean gain and its spread over seeds. Run after ``make run``:

    .venv/bin/python benchmarks/grpo_repeat.py configs/default.yaml RUN/dpo-KEY/stage RUN/data-KEY/data \\
        --seeds 0 1 2 --k 16
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from artifacts.errors import LifecycleError
from evals.config import EvalConfig
from evals.results import metrics_dict
from evals.runner import run_evals
from flows.recipe import load_recipe
from training.grpo import run_grpo

METRICS = ("task_accuracy", "sampled_task_accuracy")


def score(model_dir: Path, data_dir: Path, k: int, max_new_tokens: int) -> dict[str, float]:
    config = EvalConfig(suites=["task_accuracy", "sampled_task_accuracy"], max_new_tokens=max_new_tokens,
                        batch_size=64, samples_per_prompt=k)
    return metrics_dict(run_evals(model_dir, data_dir, config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("input_model", type=Path, help="GRPO's input model dir (the DPO stage's output)")
    parser.add_argument("data", type=Path, help="the data stage's output dir")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--k", type=int, default=16, help="sampled replies per held-out prompt")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except LifecycleError as exc:  # a bad recipe, model dir or data dir: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    torch.set_num_threads(recipe.threads or torch.get_num_threads())
    max_new = recipe.evals.max_new_tokens
    before = score(args.input_model, args.data, args.k, max_new)
    rows: list[tuple[int, float, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="grpo-repeat-") as tmp:
        for seed in args.seeds:
            config = dataclasses.replace(recipe.training.grpo, seed=seed)
            started = time.perf_counter()
            result = run_grpo(config, args.input_model, args.data, Path(tmp) / f"seed{seed}")
            rows.append((seed, time.perf_counter() - started, score(result.output_dir, args.data, args.k, max_new)))
    print(f"\nGRPO ({recipe.training.grpo.max_steps} steps) from {args.input_model}; "
          f"sampled = {args.k} draws per held-out prompt at T 1.0\n")
    print("| model | seconds | greedy | gain | sampled | gain |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| input | - | {before['task_accuracy']:.3f} | - | {before['sampled_task_accuracy']:.3f} | - |")
    for seed, seconds, after in rows:
        gains = [(after[m] - before[m]) * 100 for m in METRICS]
        print(f"| GRPO seed {seed} | {seconds:.0f} | {after['task_accuracy']:.3f} | {gains[0]:+.1f} | "
              f"{after['sampled_task_accuracy']:.3f} | {gains[1]:+.1f} |")
    for metric in METRICS:
        gains = [(after[metric] - before[metric]) * 100 for _, _, after in rows]
        spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
        print(f"\n{metric}: mean gain {statistics.mean(gains):+.1f} points (sd {spread:.1f}, min {min(gains):+.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
