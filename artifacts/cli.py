"""`lifecycle bundle ...` subcommands: write, write-adapter, verify, register, resolve.

Handlers raise `LifecycleError` subclasses (BundleError, BundleVerificationError, RegistryError);
`flows/cli.py` prints `error: <message>` and exits 2, so a refused bundle is one line, no traceback.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from artifacts.common.cli import main_with_subcommands
from artifacts.errors import ConfigError
from artifacts.manifest import Lineage, Manifest, manifest_digest

TRACKING_URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI or the pipeline's store under $LIFECYCLE_HOME)"


def _summary(bundle: Path, manifest: Manifest, title: str) -> str:
    """A short table: files with size and owner count, then the identity lines."""
    shard_tensors: dict[str, int] = {}
    for info in manifest.shard_plan.tensors.values():
        shard_tensors[info.shard] = shard_tensors.get(info.shard, 0) + 1
    width = max(len(f.path) for f in manifest.files)
    lines = [f"{title}: {bundle}", f"  {'file':<{width}}  {'bytes':>12}  tensors"]
    for entry in manifest.files:
        count = shard_tensors.get(entry.path)
        lines.append(f"  {entry.path:<{width}}  {entry.size:>12}  {count if count is not None else ''}")
    q = manifest.quantization
    lines += [
        f"  name {manifest.name}  version {manifest.version}",
        (f"  quantization {f'{q.method} {q.bits}-bit g{q.group_size}' if q else 'none'}  "
         f"tp degrees {','.join(sorted(manifest.shard_plan.tp, key=int)) or '-'}  "
         f"max context {manifest.context.max_context}"),
        f"  manifest sha256 {manifest_digest(bundle)}",
    ]
    return "\n".join(lines)


def _cmd_verify(args: argparse.Namespace) -> int:
    from artifacts.adapter_bundle import is_adapter_bundle, verify_adapter_bundle
    from artifacts.verify import verify_bundle

    bundle = Path(args.dir)
    if is_adapter_bundle(bundle):
        if args.base is not None:
            verify_bundle(args.base)
        adapter = verify_adapter_bundle(bundle, base=args.base)
        lora, base = adapter.lora, adapter.base
        print(f"verified adapter: {bundle}\n  name {adapter.name}  version {adapter.version}  rank {lora.rank}  "
              f"alpha {lora.alpha:g}  targets {','.join(lora.target_modules)}  layers {lora.layers}\n"
              f"  base {base.name}:{base.version} (manifest sha256 {base.manifest_digest})"
              + ("" if args.base is None else f", matched by {args.base}"))
        return 0
    if args.base is not None:
        raise ConfigError(f"--base: {bundle} is a model bundle, not an adapter bundle")
    manifest = verify_bundle(bundle, tp_degree=args.tp)
    print(_summary(bundle, manifest, "verified"))
    return 0


def _cmd_write_adapter(args: argparse.Namespace) -> int:
    from artifacts.adapter_bundle import verify_adapter_bundle, write_adapter_bundle
    from artifacts.verify import verify_bundle

    verify_bundle(args.base)
    out = write_adapter_bundle(args.adapter_dir, args.out, args.base, name=args.name, version=args.version)
    adapter = verify_adapter_bundle(out, base=args.base)
    print(f"wrote adapter: {out}\n  name {adapter.name}  version {adapter.version}  rank {adapter.lora.rank}  "
          f"base {adapter.base.name}:{adapter.base.version} (manifest sha256 {adapter.base.manifest_digest})")
    return 0


def _parse_pairs(pairs: list[str] | None, flag: str) -> dict[str, str]:
    result = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag}: expected KEY=VALUE, got {pair!r}")
        result[key] = value
    return result


def _cmd_write(args: argparse.Namespace) -> int:
    from artifacts.manifest import read_manifest
    from artifacts.writer import BundleConfig, write_bundle

    try:
        config = BundleConfig(name=args.name, version=args.version, max_shard_size=args.max_shard_size,
                              tp_degrees=args.tp or [1, 2], max_context=args.max_context)
    except ValueError as exc:
        raise ConfigError(f"bundle write: {exc}") from exc
    lineage = Lineage(base_model=args.base_model or "", stage_runs=_parse_pairs(args.stage_run, "--stage-run"),
                      dataset_digests=_parse_pairs(args.dataset_digest, "--dataset-digest"))
    out = write_bundle(args.model_dir, args.out, config, lineage)
    print(_summary(out, read_manifest(out), "wrote"))
    return 0


def _cmd_register(args: argparse.Namespace) -> int:
    from artifacts.common.workdir import resolve_tracking_uri
    from artifacts.registry import register_bundle

    ref = register_bundle(args.dir, args.model_name, tracking_uri=resolve_tracking_uri(args.tracking_uri),
                          description=args.description, aliases=args.alias or ())
    aliases = f" aliases {','.join(ref.aliases)}" if ref.aliases else ""
    print(f"registered {ref.uri}{aliases}\n  source {ref.source}\n  manifest sha256 {ref.manifest_digest}")
    return 0


def _cmd_resolve(args: argparse.Namespace) -> int:
    from artifacts.common.workdir import resolve_tracking_uri
    from artifacts.manifest import read_manifest
    from artifacts.registry import resolve_bundle

    path = resolve_bundle(args.uri, args.dest, tracking_uri=resolve_tracking_uri(args.tracking_uri), tp_degree=args.tp)
    print(_summary(path, read_manifest(path), f"resolved {args.uri}"))
    print(json.dumps({"path": str(path)}))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add `bundle {write,verify,register,resolve}`; each sets `func(args) -> int` via set_defaults."""
    bundle = subparsers.add_parser("bundle", help="write, verify, register and resolve model bundles")
    sub = bundle.add_subparsers(dest="bundle_command", required=True)

    p = sub.add_parser("verify", help="recompute a bundle's checksums and contracts; one line on failure")
    p.add_argument("dir")
    p.add_argument("--tp", type=int, default=None, help="also check this tensor-parallel degree fits")
    p.add_argument("--base", default=None, metavar="BASE_BUNDLE",
                   help="for an adapter bundle: the base bundle it must have been trained on")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("write-adapter", help="package a PEFT LoRA adapter dir, trained on a base bundle")
    p.add_argument("adapter_dir")
    p.add_argument("out")
    p.add_argument("--base", required=True, metavar="BASE_BUNDLE", help="the base bundle it was trained on")
    p.add_argument("--name", required=True)
    p.add_argument("--version", default="1")
    p.set_defaults(func=_cmd_write_adapter)

    p = sub.add_parser("write", help="package a HF safetensors model dir as a bundle")
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--name", required=True)
    p.add_argument("--version", default="auto")
    p.add_argument("--max-shard-size", default="5MB")
    p.add_argument("--tp", type=int, action="append", help="TP degree to plan (repeatable; default 1 and 2)")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--base-model", default=None)
    p.add_argument("--stage-run", action="append", metavar="STAGE=RUN_ID")
    p.add_argument("--dataset-digest", action="append", metavar="NAME=SHA256")
    p.set_defaults(func=_cmd_write)

    p = sub.add_parser("register", help="register a verified bundle as an MLflow model version")
    p.add_argument("dir")
    p.add_argument("--model-name", required=True)
    p.add_argument("--alias", action="append")
    p.add_argument("--description", default=None)
    p.add_argument("--tracking-uri", default=None, help=TRACKING_URI_HELP)
    p.set_defaults(func=_cmd_register)

    p = sub.add_parser("resolve", help="download models:/name@alias or models:/name/N and verify it")
    p.add_argument("uri")
    p.add_argument("--dest", required=True)
    p.add_argument("--tracking-uri", default=None, help=TRACKING_URI_HELP)
    p.add_argument("--tp", type=int, default=None)
    p.set_defaults(func=_cmd_resolve)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m artifacts.cli bundle verify DIR`) with the same one-line errors."""
    return main_with_subcommands("lifecycle", register_cli, argv)


if __name__ == "__main__":
    raise SystemExit(main())
