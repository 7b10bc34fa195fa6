"""GRPO's gain, repeated over seeds: is the pipeline's one GRPO figure signal or luck?

Runs the recipe's GRPO stage from one input model (the DPO stage's output) once per seed, then scores the
input, every earlier model you name with ``--earlier`` (SFT, ...) and every GRPO output on the held-out set:
greedy task accuracy (per slice: digits and carries), sampled accuracy (``--k`` draws per prompt at T 1.0,
the server's default; the same draws for every model, see ``evals.generation``), refusals of harmful
prompts and over-refusals of their benign look-alikes. The tables end with the mean gain over the *best*
earlier model and its spread over seeds, the figure the recipe is tuned against. Run after ``make run``:

    .venv/bin/python benchmarks/grpo_repeat.py configs/default.yaml RUN/dpo-KEY/stage RUN/data-KEY/data \\
        --earlier sft=RUN/sft-KEY/stage --seeds 0 1 2 --k 8

``--set key=value`` overrides a field of the recipe's GRPO section for a sweep (``--set learning_rate=1e-3``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from artifacts.common.cli import exit_status  # noqa: E402
from artifacts.errors import LifecycleError  # noqa: E402
from evals.config import EvalConfig  # noqa: E402
from evals.results import metrics_dict  # noqa: E402
from evals.runner import run_evals  # noqa: E402
from flows.recipe import load_recipe  # noqa: E402
from flows.report import slice_table  # noqa: E402
from training.grpo import run_grpo  # noqa: E402

RATES = ("task_accuracy", "sampled_task_accuracy", "refusal_rate", "over_refusal_rate")


def score(model_dir: Path, data_dir: Path, k: int, max_new_tokens: int) -> dict[str, float]:
    config = EvalConfig(suites=["task_accuracy", "sampled_task_accuracy", "safety", "preference_accuracy",
                                "structured"],
                        max_new_tokens=max_new_tokens,
                        batch_size=64, samples_per_prompt=k)
    return metrics_dict(run_evals(model_dir, data_dir, config))


def one_line_exit(run: Callable[[], int]) -> int:
    """A training benchmark's exit status through the project's ``exit_status``: a bad recipe, key, value, model
    or dir (a ``LifecycleError``, or the ``ValueError`` / ``TypeError`` / ``OSError`` a config or path raises) is
    ``error: <cause>`` and exit 2, never a traceback."""
    def checked() -> int:
        try:
            return run()
        except (ValueError, TypeError, OSError) as exc:
            raise LifecycleError(str(exc)) from exc

    return exit_status(checked)


def override(text: str) -> tuple[str, object]:
    """``key=value``; numbers as numbers (YAML reads ``1e-3`` as a string), anything else as YAML."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected key=value")
    for number in (int, float):
        try:
            return key, number(value)
        except ValueError:
            pass
    return key, yaml.safe_load(value)


def _labelled(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--earlier {text!r}: expected label=model_dir")
    return label, Path(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("input_model", type=Path, help="GRPO's input model dir (the DPO stage's output)")
    parser.add_argument("data", type=Path, help="the data stage's output dir")
    parser.add_argument("--earlier", type=_labelled, action="append", default=[],
                        help="label=model_dir of an earlier stage to beat (repeatable), e.g. sft=RUN/sft-KEY/stage")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--k", type=int, default=8, help="sampled replies per held-out prompt")
    parser.add_argument("--set", type=override, action="append", default=[], dest="overrides",
                        help="key=value override of the recipe's GRPO section (repeatable)")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (LifecycleError, ValueError, TypeError) as exc:  # a bad recipe, override, model or data dir
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    torch.set_num_threads(recipe.threads or torch.get_num_threads())
    max_new = recipe.evals.max_new_tokens
    grpo = dataclasses.replace(recipe.training.grpo, **dict(args.overrides))
    earlier = {"input": score(args.input_model, args.data, args.k, max_new)}
    for label, model_dir in args.earlier:
        earlier[label] = score(model_dir, args.data, args.k, max_new)
    rows: list[tuple[int, float, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="grpo-repeat-") as tmp:
        for seed in args.seeds:
            started = time.perf_counter()
            result = run_grpo(dataclasses.replace(grpo, seed=seed), args.input_model, args.data, Path(tmp) / f"s{seed}")
            seconds = time.perf_counter() - started
            rows.append((seed, seconds, score(result.output_dir, args.data, args.k, max_new)))
    print_tables(grpo, args, earlier, rows)
    return 0


def print_tables(grpo, args: argparse.Namespace, earlier: dict[str, dict[str, float]],
                 rows: list[tuple[int, float, dict[str, float]]]) -> None:
    best_label = max(earlier, key=lambda label: earlier[label]["task_accuracy"])
    best = earlier[best_label]
    print(f"\nGRPO ({grpo.max_steps} steps x {grpo.batch_size} completions, lr {grpo.learning_rate:g}, "
          f"T {grpo.temperature:g}) from {args.input_model}; sampled = {args.k} draws per held-out prompt at T 1.0; "
          f"gains against the best earlier model by greedy accuracy ({best_label})\n")
    print("| model | seconds | greedy | gain | sampled | gain | refusal | over-refusal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, m in earlier.items():
        print(f"| {label} | - | {m['task_accuracy']:.3f} | - | {m['sampled_task_accuracy']:.3f} | - | "
              f"{m['refusal_rate']:.3f} | {m['over_refusal_rate']:.3f} |")
    for seed, seconds, m in rows:
        print(f"| GRPO seed {seed} | {seconds:.0f} | {m['task_accuracy']:.3f} | "
              f"{(m['task_accuracy'] - best['task_accuracy']) * 100:+.1f} | {m['sampled_task_accuracy']:.3f} | "
              f"{(m['sampled_task_accuracy'] - best['sampled_task_accuracy']) * 100:+.1f} | "
              f"{m['refusal_rate']:.3f} | {m['over_refusal_rate']:.3f} |")
    print()
    for metric in RATES:
        values = [m[metric] for _, _, m in rows]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{metric}: mean {statistics.mean(values):.3f} (sd {spread:.3f}, min {min(values):.3f}, "
              f"max {max(values):.3f}); {best_label} {best[metric]:.3f}")
    seconds = [s for _, s, _ in rows]
    print(f"GRPO stage seconds: mean {statistics.mean(seconds):.0f}, max {max(seconds):.0f}")
    columns, table = slice_table({**earlier, **{f"GRPO seed {seed}": m for seed, _, m in rows}})
    if columns:
        print("\ngreedy task accuracy by slice:\n")
        print("| model | " + " | ".join(columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for label, cells in table:
            print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
