"""Does GRPO earn its place whatever the earlier stages drew? The whole post-training chain, once per seed.

SFT on this machine is a lottery: from one base and one dataset, five seeds of the default recipe's SFT gave
held-out greedy accuracy 0.575 to 0.91. A GRPO gain measured from one input model (``grpo_repeat.py``) says
nothing about that spread. This runs the recipe's SFT, DPO and GRPO stages from the base model once per seed
(every stage seeded alike), scores every stage on the held-out set (greedy task accuracy and its slices,
sampled accuracy at T 1.0 with ``--k`` draws, refusals, over-refusals) and prints, per seed, GRPO's gain over
the best earlier stage of the same seed, then the mean and spread over seeds. Run after ``make run``:

    .venv/bin/python benchmarks/grpo_seeds.py configs/default.yaml WORKDIR/models/base/KEY \\
        WORKDIR/runs/tiny-default/data-KEY/data --seeds 0 1 2

``--set stage.key=value`` overrides a field of a stage's section (``--set grpo.max_steps=80``). Seeds can run as
separate processes (``--seeds 1 --json s1.json``, ...) and be tabled together: ``--report s0.json s1.json ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.grpo_repeat import RATES, one_line_exit, override, score  # noqa: E402
from flows.recipe import load_recipe  # noqa: E402
from flows.report import slice_table  # noqa: E402
from training.dpo import run_dpo  # noqa: E402
from training.grpo import run_grpo  # noqa: E402
from training.sft import run_sft  # noqa: E402

STAGES = {"sft": run_sft, "dpo": run_dpo, "grpo": run_grpo}


@dataclasses.dataclass
class SeedChain:
    """One seed's chain: each stage's scores and wall seconds."""

    seed: int
    scores: dict[str, dict[str, float]]
    seconds: dict[str, float]

    @property
    def best_earlier(self) -> str:
        return max(("sft", "dpo"), key=lambda stage: self.scores[stage]["task_accuracy"])

    def gain(self, metric: str = "task_accuracy") -> float:
        return self.scores["grpo"][metric] - self.scores[self.best_earlier][metric]


def _stage_override(text: str) -> tuple[str, str, object]:
    key, value = override(text)
    stage, dot, field = key.partition(".")
    if not dot or stage not in STAGES:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected sft|dpo|grpo.key=value")
    return stage, field, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path, nargs="?")
    parser.add_argument("base_model", type=Path, nargs="?", help="the base model dir (SFT's input)")
    parser.add_argument("data", type=Path, nargs="?", help="the data stage's output dir")
    parser.add_argument("--report", type=Path, nargs="+", help="table the chains of earlier --json files instead")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--k", type=int, default=8, help="sampled replies per held-out prompt")
    parser.add_argument("--set", type=_stage_override, action="append", default=[], dest="overrides",
                        help="stage.key=value override of a stage's section (repeatable)")
    parser.add_argument("--workdir", type=Path, help="keep every stage's output here (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the scores as JSON here")
    parser.add_argument("--threads", type=int, help="torch threads (default: the recipe's); 1 and 2 stand in for "
                        "two hosts, whose float arithmetic differs the way two CPU families' does")
    return parser.parse_args(argv)


def run_chain(recipe: Any, args: argparse.Namespace, seed: int, workdir: Path) -> SeedChain:
    scores: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}
    model = args.base_model
    for stage, run_stage in STAGES.items():
        fields = {field: value for name, field, value in args.overrides if name == stage}
        config = dataclasses.replace(getattr(recipe.training, stage), seed=seed, **fields)
        started = time.perf_counter()
        model = run_stage(config, model, args.data, workdir / f"s{seed}" / stage).output_dir
        seconds[stage] = time.perf_counter() - started
        scores[stage] = score(model, args.data, args.k, recipe.evals.max_new_tokens)
        print(f"seed {seed} {stage}: greedy {scores[stage]['task_accuracy']:.3f}, refusal "
              f"{scores[stage]['refusal_rate']:.3f}, json acc {scores[stage]['constrained_task_accuracy']:.3f} "
              f"in {seconds[stage]:.0f} s", file=sys.stderr, flush=True)
    return SeedChain(seed, scores, seconds)


def _per_stage(chain: SeedChain, metric: str) -> str:
    return " / ".join(f"{chain.scores[s][metric]:.3f}" if metric in chain.scores[s] else "n/a" for s in STAGES)


def print_tables(chains: list[SeedChain], k: int) -> None:
    print(f"\nSFT -> DPO -> GRPO per seed; greedy task accuracy, sampled = {k} draws per held-out prompt at T 1.0; "
          "gain = GRPO minus the better of that seed's SFT and DPO\n")
    print("| seed | SFT | DPO | GRPO | gain | sampled SFT/DPO/GRPO | refusal (GRPO) | over-refusal (GRPO) | GRPO s |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for c in chains:
        g = c.scores["grpo"]
        sampled = " / ".join(f"{c.scores[s]['sampled_task_accuracy']:.3f}" for s in STAGES)
        print(f"| {c.seed} | {c.scores['sft']['task_accuracy']:.3f} | {c.scores['dpo']['task_accuracy']:.3f} | "
              f"{g['task_accuracy']:.3f} | {c.gain() * 100:+.1f} | {sampled} | {g['refusal_rate']:.3f} | "
              f"{g['over_refusal_rate']:.3f} | {c.seconds['grpo']:.0f} |")
    print("\nWhat each stage exists for, per chain (refusal, preference accuracy and the JSON answers at every "
          "stage; pref acc on the held-out static pairs, json acc under the grammar, json own = valid JSON "
          "unconstrained, where a chain was scored for them):\n")
    print("| seed | refusal SFT / DPO / GRPO | pref acc SFT / DPO / GRPO | json acc SFT / DPO / GRPO | "
          "json own SFT / DPO / GRPO | over-refusal (GRPO) |")
    print("|---|---|---|---|---|---:|")
    for c in chains:
        refusals = _per_stage(c, "refusal_rate")
        prefs = _per_stage(c, "preference_accuracy")
        json_acc, json_own = _per_stage(c, "constrained_task_accuracy"), _per_stage(c, "json_schema_adherence")
        print(f"| {c.seed} | {refusals} | {prefs} | {json_acc} | {json_own} | "
              f"{c.scores['grpo']['over_refusal_rate']:.3f} |")
    print()
    gains = [c.gain() * 100 for c in chains]
    spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
    print(f"GRPO gain over the best earlier stage (points): mean {statistics.mean(gains):+.1f} (sd {spread:.1f}, "
          f"min {min(gains):+.1f}, max {max(gains):+.1f})")
    for metric in RATES:
        for stage in STAGES:
            values = [c.scores[stage][metric] for c in chains]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"{stage} {metric}: mean {statistics.mean(values):.3f} (sd {sd:.3f}, min {min(values):.3f}, "
                  f"max {max(values):.3f})")
    grpo_seconds = [c.seconds["grpo"] for c in chains]
    print(f"GRPO stage seconds: mean {statistics.mean(grpo_seconds):.0f}, max {max(grpo_seconds):.0f}")
    columns, table = slice_table({f"{stage} seed {c.seed}": c.scores[stage] for c in chains for stage in STAGES})
    if columns:
        print("\ngreedy task accuracy by slice:\n")
        print("| model | " + " | ".join(columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for label, cells in table:
            print(f"| {label} | " + " | ".join(cells) + " |")


def report(paths: list[Path], k: int) -> int:
    chains = [SeedChain(**chain) for path in paths for chain in json.loads(path.read_text(encoding="utf-8"))]
    print_tables(sorted(chains, key=lambda c: c.seed), k)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.report:
        return report(args.report, args.k)
    if args.data is None:
        raise ValueError("give RECIPE BASE_MODEL DATA, or --report JSON...")
    recipe = load_recipe(args.recipe)
    torch.set_num_threads(args.threads or recipe.threads or torch.get_num_threads())
    with tempfile.TemporaryDirectory(prefix="grpo-seeds-") as tmp:
        workdir = args.workdir or Path(tmp)
        chains = [run_chain(recipe, args, seed, workdir) for seed in args.seeds]
    print_tables(chains, args.k)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(c) for c in chains], indent=1), encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return one_line_exit(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
