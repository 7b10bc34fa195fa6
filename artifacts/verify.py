"""`verify_bundle`: recompute everything a manifest claims and name the first disagreement.

Order matters for the message a user gets: structural checks that explain *what* is wrong (a missing or
extra file, a weight map naming an unknown shard, a truncated shard, a tensor shaped unlike config.json, a
tokenizer larger than the embedding, a chat template that does not render, an unsupported quantization,
a TP degree that does not fit) run first; the sha256/size comparison runs last and catches any remaining
byte-level change. Shapes and dtypes come from safetensors headers, so nothing is loaded into memory.

`eval_record.json` is not part of the snapshot and is ignored here (see `artifacts.eval_record`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from artifacts.digests import sha256_file
from artifacts.errors import BundleVerificationError
from artifacts.manifest import EVAL_RECORD_FILE, INDEX_FILE, MANIFEST_FILE, Manifest, read_manifest
from artifacts.model_spec import SpecError, check_layout, model_spec, quantization_from_config
from artifacts.safetensors_io import HeaderTensor, read_header
from artifacts.shard_plan import TPDegreeError, plan_shards
from artifacts.tokenizer_files import TokenizerFilesError, read_tokenizer, render_probe
from artifacts.writer import generation_defaults, math_bytes

_NOT_IN_SNAPSHOT = {MANIFEST_FILE, EVAL_RECORD_FILE}


def _fail(file: str, reason: str) -> BundleVerificationError:
    return BundleVerificationError(file, reason)


def _json(bundle: Path, name: str) -> Any:
    try:
        return json.loads((bundle / name).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _fail(name, "missing") from None
    except json.JSONDecodeError as exc:
        raise _fail(name, f"not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    except UnicodeDecodeError as exc:
        raise _fail(name, "not UTF-8 text") from exc


def _check_files(bundle: Path, manifest: Manifest) -> None:
    listed = {entry.path for entry in manifest.files}
    shards = set(manifest.shard_plan.shards)
    for entry in manifest.files:
        if not (bundle / entry.path).is_file():
            kind = "shard" if entry.path in shards else "file"
            raise _fail(entry.path, f"missing {kind} (listed in the manifest)")
    for root, _, names in os.walk(bundle):
        for name in sorted(names):
            rel = (Path(root) / name).relative_to(bundle).as_posix()
            if rel not in listed and rel not in _NOT_IN_SNAPSHOT:
                raise _fail(rel, "extra file not listed in the manifest")
    for shard in shards:
        if shard not in listed:
            raise _fail(shard, "shard in the shard plan but not in the manifest's file list")


def _check_index(bundle: Path, manifest: Manifest) -> dict[str, str]:
    if not (bundle / INDEX_FILE).is_file():
        raise _fail(INDEX_FILE, "missing")
    index = _json(bundle, INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise _fail(INDEX_FILE, "no weight_map")
    shards = set(manifest.shard_plan.shards)
    for tensor, shard in weight_map.items():
        if shard not in shards:
            raise _fail(INDEX_FILE, f"weight_map puts tensor {tensor} in {shard}, which is not a shard of "
                                    "this bundle's manifest")
    planned = manifest.shard_plan.weight_map
    for tensor, shard in weight_map.items():
        if tensor not in planned:
            raise _fail(INDEX_FILE, f"weight_map names tensor {tensor}, unknown to the manifest's shard plan")
        if planned[tensor] != shard:
            raise _fail(INDEX_FILE, f"weight_map puts tensor {tensor} in {shard}, the manifest in "
                                    f"{planned[tensor]}")
    for tensor, shard in planned.items():
        if tensor not in weight_map:
            raise _fail(INDEX_FILE, f"weight_map lacks tensor {tensor} (manifest: {shard})")
    for shard in sorted(shards - set(weight_map.values())):
        raise _fail(shard, "shard holds no tensor of the weight_map")
    declared = (index.get("metadata") or {}).get("total_size")
    planned_bytes = sum(math_bytes(t.dtype, t.shape) for t in manifest.shard_plan.tensors.values())
    if declared is not None and declared != planned_bytes:
        raise _fail(INDEX_FILE, f"metadata.total_size {declared} differs from the tensors' {planned_bytes} bytes")
    return weight_map


def _check_headers(bundle: Path, manifest: Manifest, weight_map: dict[str, str]) -> dict[str, HeaderTensor]:
    tensors: dict[str, HeaderTensor] = {}
    for shard in manifest.shard_plan.shards:
        header = read_header(bundle / shard, shard)
        expected = {t for t, s in weight_map.items() if s == shard}
        for name in sorted(set(header) - expected):
            raise _fail(shard, f"holds tensor {name}, which the weight_map does not place here")
        for name in sorted(expected - set(header)):
            raise _fail(shard, f"weight_map places tensor {name} here but the file does not hold it")
        for name, entry in header.items():
            info = manifest.shard_plan.tensors[name]
            if entry.dtype != info.dtype or entry.shape != info.shape:
                raise _fail(shard, f"tensor {name} is {entry.dtype}{entry.shape}, the manifest says "
                                   f"{info.dtype}{info.shape}")
            tensors[name] = entry
    return tensors


def _check_against_config(bundle: Path, manifest: Manifest, tensors: dict[str, HeaderTensor],
                          weight_map: dict[str, str]) -> tuple[Any, Any]:
    config = _json(bundle, "config.json")
    try:
        spec = model_spec(config)
        quant = quantization_from_config(config)
    except SpecError as exc:
        message = str(exc)
        file, _, reason = message.partition(": ")
        raise _fail(file, reason) from exc
    if asdict(spec.arch) != asdict(manifest.architecture):
        diff = next(k for k, v in asdict(spec.arch).items() if asdict(manifest.architecture).get(k) != v)
        raise _fail(MANIFEST_FILE, f"architecture.{diff} = {getattr(manifest.architecture, diff)!r} but "
                                   f"config.json says {getattr(spec.arch, diff)!r}")
    if (quant is None) != (manifest.quantization is None):
        raise _fail(MANIFEST_FILE, f"quantization {manifest.quantization and manifest.quantization.method!r} "
                                   f"but config.json says {quant and quant.method!r}")
    if quant is not None and manifest.quantization is not None:
        for key in ("method", "bits", "group_size", "format"):
            if getattr(quant, key) != getattr(manifest.quantization, key):
                raise _fail(MANIFEST_FILE, f"quantization.{key} = {getattr(manifest.quantization, key)!r} but "
                                           f"config.json says {getattr(quant, key)!r}")
    layout = {name: (t.dtype, t.shape) for name, t in tensors.items()}
    if problem := check_layout(spec, quant, layout):
        tensor, reason = problem
        raise _fail(weight_map.get(tensor, INDEX_FILE), f"tensor {tensor}: {reason}")
    return config, spec


def _check_tokenizer(bundle: Path, manifest: Manifest, tensors: dict[str, HeaderTensor]) -> None:
    try:
        found, template = read_tokenizer(bundle)
        try:
            render_probe(template, bundle)
        except TokenizerFilesError as exc:
            raise TokenizerFilesError(found.chat_template_source, f"chat template {exc.reason}") from exc
    except TokenizerFilesError as exc:
        raise _fail(exc.file, exc.reason) from exc
    vocab, recorded = found.vocab_size, manifest.tokenizer
    rows = tensors["model.embed_tokens.weight"].shape[0]
    if vocab > rows:
        raise _fail("tokenizer.json", f"tokenizer has {vocab} tokens but the embedding has {rows} rows "
                                      "(tokenizer from another model?)")
    if vocab != recorded.vocab_size:
        raise _fail("tokenizer.json", f"tokenizer has {vocab} tokens, the manifest says {recorded.vocab_size}")
    if found.files != recorded.files:
        raise _fail(MANIFEST_FILE, f"tokenizer files {found.files} differ from the manifest's {recorded.files}")
    if found.digest != recorded.digest:
        raise _fail(found.files[0], "tokenizer digest differs from the manifest's")
    if found.chat_template_source != recorded.chat_template_source or \
            found.chat_template_digest != recorded.chat_template_digest:
        raise _fail(found.chat_template_source, "chat template differs from the manifest's (digest mismatch)")


def _check_contracts(bundle: Path, manifest: Manifest) -> None:
    ctx = manifest.context
    if ctx.max_context < 1 or ctx.max_context > manifest.architecture.max_position_embeddings:
        raise _fail(MANIFEST_FILE, f"context.max_context {ctx.max_context} outside 1.."
                                   f"{manifest.architecture.max_position_embeddings} (max_position_embeddings)")
    if (bundle / "generation_config.json").is_file() and generation_defaults(bundle) != manifest.generation_defaults:
        raise _fail("generation_config.json", "generation defaults differ from the manifest's")


def _check_tp(manifest: Manifest, tensors: dict[str, HeaderTensor], weight_map: dict[str, str],
              tp_degree: int | None) -> None:
    arch = manifest.architecture
    shapes = {name: t.shape for name, t in tensors.items()}
    degrees = sorted({int(d) for d in manifest.shard_plan.tp} | ({tp_degree} if tp_degree else set()))
    for degree in degrees:
        try:
            plan = plan_shards(shapes, degree, arch.num_heads, arch.num_kv_heads)
        except TPDegreeError as exc:
            raise _fail(weight_map.get(exc.tensor or "", "config.json"), str(exc)) from exc
        recorded = manifest.shard_plan.tp.get(str(degree))
        if recorded is None:
            continue
        if recorded.kv_heads is not None and recorded.kv_heads != plan.kv_heads:
            raise _fail(MANIFEST_FILE, f"shard_plan.tp[{degree}].kv_heads = {recorded.kv_heads} but the model's "
                                       f"heads give {plan.kv_heads}")
        # A manifest written before KV head ownership was recorded (kv_heads None) is checked on its tensors.
        if recorded.degree != plan.degree or asdict(recorded)["tensors"] != asdict(plan)["tensors"]:
            raise _fail(MANIFEST_FILE, f"shard_plan.tp[{degree}] disagrees with the recomputed ownership")


def _check_checksums(bundle: Path, manifest: Manifest) -> None:
    for entry in manifest.files:
        path = bundle / entry.path
        size = path.stat().st_size
        if size != entry.size:
            raise _fail(entry.path, f"size {size} bytes, the manifest says {entry.size}")
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise _fail(entry.path, f"sha256 mismatch (manifest {entry.sha256[:12]}…, file {digest[:12]}…)")


def verify_bundle(bundle_dir: str | Path, tp_degree: int | None = None) -> Manifest:
    """Return the manifest if the bundle is exactly what it claims; else raise `BundleVerificationError`.

    `tp_degree` additionally checks that the model can be split over that many ranks (degrees recorded
    in the manifest are always re-checked)."""
    bundle = Path(bundle_dir)
    if not bundle.is_dir():
        raise _fail(str(bundle), "not a directory")
    manifest = read_manifest(bundle)
    _check_files(bundle, manifest)
    weight_map = _check_index(bundle, manifest)
    tensors = _check_headers(bundle, manifest, weight_map)
    _check_against_config(bundle, manifest, tensors, weight_map)
    _check_tokenizer(bundle, manifest, tensors)
    _check_contracts(bundle, manifest)
    _check_tp(manifest, tensors, weight_map, tp_degree)
    _check_checksums(bundle, manifest)
    return manifest
