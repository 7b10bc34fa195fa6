"""`lifecycle quantize ...`: run the quantize stage on a model dir and print the fidelity table.

`register_cli(subparsers)` adds the subcommand to `lifecycle` (flows/cli.py dispatches to the handler stored in
`func`); `python -m quantize.cli ...` runs the same command standalone (used to reproduce the fidelity table).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from artifacts.common.cli import main_with_subcommands
from quantize.config import QuantizeConfig
from quantize.errors import QuantizeError


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="GPTQ/AWQ-quantize a model dir and report fidelity vs fp32")
    p.add_argument("--model", type=Path, required=True, help="full-precision HF model dir")
    p.add_argument("--data", type=Path, required=True, help="data-stage dir (calibration.jsonl, text_heldout.jsonl)")
    p.add_argument("--out", type=Path, required=True, help="output root (one dir per method + reports)")
    p.add_argument("--calibration-file", type=Path, default=None, help="own JSONL of {'text'} for calibration")
    defaults = QuantizeConfig()
    p.add_argument("--methods", default=",".join(defaults.methods), help="comma list of gptq,awq")
    p.add_argument("--bits", type=int, default=defaults.bits)
    p.add_argument("--group-size", type=int, default=defaults.group_size)
    p.add_argument("--calibration-samples", type=int, default=defaults.calibration_samples)
    p.add_argument("--calibration-seq-len", type=int, default=defaults.calibration_seq_len)
    p.add_argument("--calibration-batch-size", type=int, default=defaults.calibration_batch_size,
                   help="calibration windows per forward pass")
    p.add_argument("--fidelity-samples", type=int, default=defaults.fidelity_samples)
    p.add_argument("--no-gate", action="store_true", help="do not fail when GPTQ does not beat RTN on KL")
    p.set_defaults(func=handle_quantize)


def config_from_args(args: argparse.Namespace) -> QuantizeConfig:
    try:
        return QuantizeConfig(
            methods=[m.strip() for m in args.methods.split(",") if m.strip()],
            bits=args.bits,
            group_size=args.group_size,
            calibration_samples=args.calibration_samples,
            calibration_seq_len=args.calibration_seq_len,
            calibration_batch_size=args.calibration_batch_size,
            fidelity_samples=args.fidelity_samples,
            gate_gptq_beats_rtn=not args.no_gate,
        )
    except ValueError as err:
        raise QuantizeError(f"quantize options: {err}") from None


def handle_quantize(args: argparse.Namespace) -> int:
    from quantize.pipeline import run_quantization

    result = run_quantization(config_from_args(args), args.model, args.data, args.out, args.calibration_file)
    print(result.report.to_markdown())
    print(f"calibration digest: {result.calibration_digest}")
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in result.seconds.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return main_with_subcommands("python -m quantize.cli", register_cli, argv)


if __name__ == "__main__":
    raise SystemExit(main())
