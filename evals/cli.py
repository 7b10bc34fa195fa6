"""`lifecycle eval MODEL_DIR DATA_DIR`: run the eval suites on any HF causal-LM dir from the shell.

Handlers raise EvalError (a LifecycleError) for bad input; `flows/cli.py` turns it into one line and
exit 2. Failed gates are a verdict, not an error: the table is printed and the exit status is 1.
`python -m evals.cli eval ...` works without the `lifecycle` wrapper.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from artifacts.common.cli import main_with_subcommands
from evals.errors import EvalError


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    from evals.config import EvalConfig
    from evals.suite_names import suite_names

    defaults = EvalConfig()  # one source for the defaults: the recipe's `evals:` block and this CLI agree
    p = subparsers.add_parser("eval", help="run eval suites on a model dir against a data-stage output dir")
    p.add_argument("model_dir", help="Hugging Face causal-LM dir (with a chat template)")
    p.add_argument("data_dir", help="the data stage's output dir (tasks_heldout.jsonl, ...)")
    p.add_argument("--suites", help=f"comma-separated subset of: {','.join(suite_names())} (default: all)")
    p.add_argument("--max-examples", type=int, help="cap on records read from each data file")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--samples-per-prompt", type=int, default=defaults.samples_per_prompt,
                   help=f"sampled replies per task prompt (default {defaults.samples_per_prompt})")
    p.add_argument("--sample-temperature", type=float, default=defaults.sample_temperature,
                   help=f"temperature of the sampled_task_accuracy replies (default {defaults.sample_temperature}, "
                        "OpenAI's default)")
    p.add_argument("--structured-examples", type=int, default=defaults.structured_examples,
                   help=f"held-out tasks the structured suite asks for JSON (default {defaults.structured_examples})")
    p.add_argument("--json-out", help="write the results JSON here (atomically)")
    p.add_argument("--gate", action="append", default=[], metavar="EXPR",
                   help="promotion gate such as 'task_accuracy >= 0.4' (repeatable); exit 1 if any fails")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from evals.config import EvalConfig
    from evals.gates import check_gates, parse_gate
    from evals.results import markdown_table, write_results_json
    from evals.runner import run_evals
    from evals.suite_names import suite_names

    try:
        gates = [parse_gate(text) for text in args.gate]
        config = EvalConfig(
            suites=[s.strip() for s in args.suites.split(",") if s.strip()] if args.suites else suite_names(),
            max_examples=args.max_examples, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
            samples_per_prompt=args.samples_per_prompt, sample_temperature=args.sample_temperature,
            structured_examples=args.structured_examples,
        )
    except ValueError as exc:
        raise EvalError(f"eval: {exc}") from exc
    results = run_evals(Path(args.model_dir), Path(args.data_dir), config)
    print(markdown_table(results), end="")
    if args.json_out:
        print(f"results: {write_results_json(results, args.json_out)}")
    if gates:
        report = check_gates(results, gates)
        print(report.summary())
        return 0 if report.passed else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return main_with_subcommands("python -m evals.cli", register_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
