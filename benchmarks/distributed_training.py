"""Is a two-process training stage the same training? One recipe stage in 1 and in N processes, side by side.

Runs the recipe's SFT, DPO or GRPO stage (its own section, `distributed.num_processes` set to 1 and to each
``--processes``) from one input model on one data dir, then scores every output on the held-out set: greedy
task accuracy, the reply format, perplexity. Prints, per run: wall time, the last logged training loss, the
held-out greedy curve's last point, the eval metrics; and against one process: the largest per-step loss
difference and the largest difference of any merged weight. Run after ``make run`` (or on any base and data):

    .venv/bin/python benchmarks/distributed_training.py configs/default.yaml RUN/../models/base/KEY \\
        RUN/data-KEY/data --stage sft --processes 2 --out benchmarks/out/distributed

A finished output under ``--out`` is reused (the stage's completion marker), so a second call only scores.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from evals.config import EvalConfig  # noqa: E402
from evals.results import metrics_dict  # noqa: E402
from evals.runner import run_evals  # noqa: E402
from flows.recipe import load_recipe  # noqa: E402
from training.distributed_config import DistributedSettings  # noqa: E402
from training.heldout_curve import METRIC as HELDOUT  # noqa: E402

SUITES = ["task_accuracy", "format_adherence", "perplexity"]


def train(stage: str, config, model_dir: Path, data_dir: Path, out: Path):
    from training.dpo import run_dpo
    from training.grpo import run_grpo
    from training.sft import run_sft

    return {"sft": run_sft, "dpo": run_dpo, "grpo": run_grpo}[stage](config, model_dir, data_dir, out)


def losses(result) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in result.log_history if "loss" in row}


def weight_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return max(float((left[k] - right[k]).abs().max()) for k in left)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("model_dir", type=Path, help="the stage's input model (SFT: the base model)")
    parser.add_argument("data_dir", type=Path, help="a data stage's output")
    parser.add_argument("--stage", choices=["sft", "dpo", "grpo"], default="sft")
    parser.add_argument("--processes", type=int, nargs="+", default=[2])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/distributed"))
    args = parser.parse_args(argv)

    recipe = load_recipe(args.recipe)
    section = getattr(recipe.training, args.stage)
    evals = EvalConfig(suites=SUITES, max_new_tokens=recipe.evals.max_new_tokens, batch_size=recipe.evals.batch_size)
    rows, results = [], {}
    for n in [1, *args.processes]:
        config = dataclasses.replace(section, distributed=DistributedSettings(num_processes=n))
        result = train(args.stage, config, args.model_dir, args.data_dir, args.out / f"{args.stage}-{n}")
        results[n] = result
        metrics = metrics_dict(run_evals(result.output_dir, args.data_dir, evals))
        curve = [row[HELDOUT] for row in result.log_history if HELDOUT in row]
        step_losses = losses(result)
        rows.append((n, result.metrics.get("train_wall_seconds", float("nan")), step_losses[max(step_losses)],
                     curve[-1] if curve else float("nan"), metrics["task_accuracy"], metrics["format_adherence"],
                     metrics["perplexity"]))

    print(f"{args.stage} of {args.recipe} from {args.model_dir}")
    print(f"{'processes':>9} {'train s':>8} {'last loss':>10} {'held-out greedy':>16} {'task acc':>9} "
          f"{'format':>7} {'ppl':>7}")
    for n, wall, loss, greedy, acc, fmt, ppl in rows:
        print(f"{n:>9} {wall:>8.1f} {loss:>10.4f} {greedy:>16.3f} {acc:>9.3f} {fmt:>7.3f} {ppl:>7.3f}")
    one = losses(results[1])
    for n in args.processes:
        other = losses(results[n])
        gap = max(abs(one[step] - other[step]) for step in one if step in other)
        weights = weight_difference(results[1].output_dir, results[n].output_dir)
        print(f"{n} vs 1 process: largest per-step loss difference {gap:.2e} over {len(one)} logged steps, "
              f"largest merged-weight difference {weights:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
