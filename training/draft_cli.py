"""`lifecycle draft build`: a distilled draft model of a target, for `lifecycle serve --speculative-model`.

`register_cli(subparsers)` adds the subcommand to `lifecycle` (flows/cli.py); `python -m training.draft_cli ...`
runs the same command standalone. The flags' defaults are `DraftConfig`'s, so the recipe's `draft:` section
and this command build the same draft from the same values.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from artifacts.common.cli import main_with_subcommands
from training.draft_config import DraftConfig, DraftError

_OPTIONS = ("layers", "steps", "batch_size", "seq_len", "lr", "temperature", "eval_tokens", "seed", "threads",
            "device")


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    draft = subparsers.add_parser("draft", help="build a smaller draft model for speculative decoding")
    sub = draft.add_subparsers(dest="draft_command", required=True)
    p = sub.add_parser("build", help="the target's first layers, distilled to agree with it (KL on its text)")
    p.add_argument("--target", type=Path, required=True, help="full-precision HF model dir (Llama family)")
    p.add_argument("--out", type=Path, required=True, help="output dir of the draft (written atomically)")
    d = DraftConfig()
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers the draft keeps (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="distillation steps; 0 = plain truncation "
                                                              "(default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="KL temperature (default %(default)s)")
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens,
                   help="held-out tokens that agreement is measured on (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads; 0 = torch's choice "
                                                                  "(default %(default)s)")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda (default %(default)s)")
    p.add_argument("--text-file", type=Path, default=None,
                   help="JSONL of {'text': ...} documents to distill on (default: the embedded corpus)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=handle_build)


def config_from_args(args: argparse.Namespace) -> DraftConfig:
    try:
        return DraftConfig(**{name: getattr(args, name) for name in _OPTIONS})
    except DraftError as exc:  # "batch_size: must be >= 1" → "--batch-size: must be >= 1"
        name, _, reason = str(exc).partition(": ")
        raise DraftError(f"--{name.replace('_', '-')}: {reason}") from None


def read_texts(path: Path) -> list[str]:
    """The ``text`` field of every record of a JSONL file (a quantize calibration file reads the same)."""
    from artifacts.jsonl import iter_jsonl

    texts = []
    for lineno, record in iter_jsonl(path, DraftError):
        if not isinstance(record.get("text"), str):
            raise DraftError(f"{path}:{lineno}: expected a 'text' string field")
        texts.append(record["text"])
    return texts


def handle_build(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    texts = read_texts(args.text_file) if args.text_file is not None else None
    from training.draft import build_draft

    build = build_draft(args.target, args.out, config, texts, overwrite=args.force)
    rows = [
        ("agreement", f"{build.agreement_before:.3f} → {build.agreement:.3f}",
         f"share of {build.heldout_tokens} held-out positions where its argmax is the target's"),
        ("layers", f"{build.layers} of {build.target_layers}", ""),
        ("parameters", f"{build.draft_params / 1e6:.2f}M of {build.target_params / 1e6:.2f}M",
         f"{build.draft_params / build.target_params:.0%}"),
        ("distillation", f"{build.steps} steps",
         ("" if build.final_loss is None else f"final KL {build.final_loss:.4f}, ") + f"on {build.text_source}"),
        ("seconds", f"{build.seconds:.1f}", ""),
    ]
    width = max(len(r[1]) for r in rows)
    print(f"draft {build.path}")
    for name, value, note in rows:
        print(f"  {name:<13} {value:<{width}}  {note}".rstrip())
    print(f"serve: lifecycle serve {build.target} --speculative-tokens 4 --speculative-model {build.path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_subcommands("python -m training.draft_cli", register_cli, argv)


if __name__ == "__main__":
    raise SystemExit(main())
