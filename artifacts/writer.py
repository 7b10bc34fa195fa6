"""Write a bundle: re-shard a model dir's safetensors, copy configs and tokenizer, digest, manifest.

Why read the safetensors directly instead of loading the model: the bundle must hold exactly the tensors
that were trained or quantized. Packed GPTQ/AWQ tensors (qweight, qzeros, scales, g_idx) are copied
verbatim with their dtypes; no dequantize/requantize round trip, no framework tying or renaming weights.
Only the grouping into shards changes (`max_shard_size`, so even a tiny model exercises sharding).

Everything is written to a hidden sibling temp dir and renamed once complete, so a crashed or interrupted
build never leaves a directory that looks like a bundle.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from artifacts.common.atomic import staged_directory
from artifacts.common.sizes import parse_size
from artifacts.digests import sha256_bytes, sha256_file
from artifacts.errors import BundleError
from artifacts.manifest import (
    EVAL_RECORD_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    ArchitectureSummary,
    ContextContract,
    FileEntry,
    Lineage,
    Manifest,
    QuantizationInfo,
    ShardPlan,
    TensorInfo,
    TokenizerInfo,
    TPPlan,
)
from artifacts.model_spec import SpecError, check_layout, model_spec, natural_key, quantization_from_config
from artifacts.safetensors_io import DTYPE_BYTES, HeaderTensor, read_header, source_weight_files
from artifacts.shard_plan import plan_shards
from artifacts.tokenizer_files import TokenizerFilesError, read_tokenizer, render_probe

AUTO_VERSION = "auto"
# Extra source files a loader may need, copied verbatim when present.
EXTRA_FILES = ("quantize_config.json", "quant_config.json")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_GENERATION_KEYS_SKIPPED = ("transformers_version", "_from_model_config")


@dataclass
class BundleConfig:
    """How to package a model dir. `version` "auto" becomes a UTC timestamp plus a weights digest prefix."""

    name: str
    version: str = AUTO_VERSION
    max_shard_size: str = "5MB"
    tp_degrees: list[int] = field(default_factory=lambda: [1, 2])
    max_context: int | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name or ""):
            raise ValueError(f"name: {self.name!r} must be letters, digits, '.', '_' or '-'")
        if not _NAME.match(self.version or ""):
            raise ValueError(f"version: {self.version!r} must be letters, digits, '.', '_' or '-'")
        parse_size(self.max_shard_size, "max_shard_size")
        if not self.tp_degrees or any(not isinstance(d, int) or d < 1 for d in self.tp_degrees):
            raise ValueError(f"tp_degrees: {self.tp_degrees!r} must be a non-empty list of integers >= 1")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context: {self.max_context} must be positive")


def _load_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{path}: missing") from None
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path}: not valid JSON ({exc.msg})") from exc


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def generation_defaults(directory: Path) -> dict[str, Any]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    data = _load_json(path)
    return {k: v for k, v in data.items() if k not in _GENERATION_KEYS_SKIPPED}


def group_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy, in network order: a shard closes when the next tensor would overflow it.

    A tensor larger than the limit gets a shard to itself (it cannot be split across files)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes, key=natural_key):
        if shards[-1] and used + sizes[name] > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def shard_file_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def _resolve_quantization(
    config: dict[str, Any], given: QuantizationInfo | None, model_dir: Path
) -> QuantizationInfo | None:
    try:
        from_config = quantization_from_config(config)
    except SpecError as exc:
        raise BundleError(f"{model_dir}/{exc}") from exc
    if given is None:
        return from_config
    if from_config is None:
        raise BundleError(f"{model_dir}/config.json: quantization given ({given.method}) but config.json has "
                          "no quantization_config")
    for key in ("method", "bits", "group_size"):
        if getattr(given, key) != getattr(from_config, key):
            raise BundleError(f"{model_dir}/config.json: quantization {key}={getattr(from_config, key)!r} "
                              f"disagrees with the given {getattr(given, key)!r}")
    return dataclasses.replace(from_config, calibration_digest=given.calibration_digest)


@dataclass
class _Source:
    """A model dir as read and checked before anything is written: its config, and where each tensor is."""

    model_dir: Path
    hf_config: dict[str, Any]
    arch: ArchitectureSummary
    quant: QuantizationInfo | None
    locations: dict[str, Path]  # tensor -> the source file holding it
    tensors: dict[str, HeaderTensor]  # tensor -> its header entry (dtype, shape, byte range)
    tokenizer: TokenizerInfo


@dataclass
class _Plan:
    """How the bundle is cut: shards (names, tensors of each) and tensor-parallel ownership per degree."""

    max_bytes: int
    shard_names: list[str]
    groups: list[list[str]]
    tp: dict[str, TPPlan]
    max_context: int


def write_bundle(
    model_dir: str | Path,
    out_dir: str | Path,
    config: BundleConfig,
    lineage: Lineage,
    quantization: QuantizationInfo | None = None,
    eval_record: Any | None = None,
) -> Path:
    """Package `model_dir` (a HF safetensors dir) as a bundle at `out_dir`; returns `out_dir`.

    Raises `BundleError` naming the file and reason for anything a server could not trust."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    _check_paths(model_dir, out_dir)
    source = _read_source(model_dir, quantization)
    plan = _plan(source, config)
    try:
        with staged_directory(out_dir, if_exists="fail") as tmp:
            tensor_infos = _write_weights(source, plan, tmp)
            gen_defaults = _copy_configs(source, tmp)
            manifest = _manifest(source, plan, config, lineage, tensor_infos, gen_defaults, tmp)
            (tmp / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
            if eval_record is not None:
                from artifacts.eval_record import write_eval_record

                write_eval_record(tmp, eval_record)
    except FileExistsError as exc:
        raise BundleError(f"{out_dir}: appeared while the bundle was being written; not replacing it") from exc
    return out_dir


def _check_paths(model_dir: Path, out_dir: Path) -> None:
    if out_dir.exists() and (out_dir / MANIFEST_FILE).exists():
        raise BundleError(f"{out_dir}: a complete bundle already exists here; refusing to overwrite it")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise BundleError(f"{out_dir}: exists and is not an empty directory")
    if not model_dir.is_dir():
        raise BundleError(f"{model_dir}: not a directory")


def _read_source(model_dir: Path, quantization: QuantizationInfo | None) -> _Source:
    """config.json, the tensors as the source stores them and the tokenizer, checked against each other."""
    hf_config = _load_json(model_dir / "config.json")
    try:
        spec = model_spec(hf_config)
    except SpecError as exc:
        raise BundleError(f"{model_dir}/{exc}") from exc
    quant = _resolve_quantization(hf_config, quantization, model_dir)

    # The layout must satisfy config.json before anything is written.
    locations = source_weight_files(model_dir)
    headers = {path: read_header(path, str(path)) for path in set(locations.values())}
    tensors = {name: headers[path][name] for name, path in locations.items() if name in headers[path]}
    if missing := sorted(set(locations) - set(tensors)):
        raise BundleError(f"{model_dir}: index names tensor {missing[0]} but its shard does not contain it")
    layout = {name: (t.dtype, t.shape) for name, t in tensors.items()}
    if problem := check_layout(spec, quant, layout):
        raise BundleError(f"{locations.get(problem[0], model_dir)}: tensor {problem[0]}: {problem[1]}")

    # Tokenizer and chat template: a bundle a server cannot chat with is refused here, not at serve time.
    try:
        tokenizer, template = read_tokenizer(model_dir)
        render_probe(template, model_dir)
    except TokenizerFilesError as exc:
        raise BundleError(f"{model_dir}/{exc}") from exc
    embed_rows = tensors["model.embed_tokens.weight"].shape[0]
    if tokenizer.vocab_size > embed_rows:
        raise BundleError(f"{model_dir}/tokenizer.json: tokenizer has {tokenizer.vocab_size} tokens but the "
                          f"embedding has {embed_rows} rows")
    return _Source(model_dir, hf_config, spec.arch, quant, locations, tensors, tokenizer)


def _plan(source: _Source, config: BundleConfig) -> _Plan:
    arch = source.arch
    max_context = config.max_context or arch.max_position_embeddings
    if max_context > arch.max_position_embeddings:
        raise BundleError(f"max_context: {max_context} exceeds config.json max_position_embeddings "
                          f"{arch.max_position_embeddings}")
    shapes = {name: t.shape for name, t in source.tensors.items()}
    tp = {str(d): plan_shards(shapes, d, arch.num_heads, arch.num_kv_heads) for d in config.tp_degrees}
    max_bytes = parse_size(config.max_shard_size, "max_shard_size")
    groups = group_shards({n: t.end - t.begin for n, t in source.tensors.items()}, max_bytes)
    shard_names = [shard_file_name(i + 1, len(groups)) for i in range(len(groups))]
    return _Plan(max_bytes, shard_names, groups, tp, max_context)


def _write_weights(source: _Source, plan: _Plan, tmp: Path) -> dict[str, TensorInfo]:
    """The shards and their index (HF's model.safetensors.index.json); what each tensor became."""
    tensor_infos: dict[str, TensorInfo] = {}
    for shard_name, names in tqdm(list(zip(plan.shard_names, plan.groups)), desc="writing shards", unit="shard",
                                  disable=len(plan.groups) < 4):
        _write_shard(source.locations, names, tmp / shard_name)
        for name in names:
            tensor_infos[name] = TensorInfo(shard_name, source.tensors[name].dtype, list(source.tensors[name].shape))
    total = sum(math_bytes(t.dtype, t.shape) for t in tensor_infos.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {n: tensor_infos[n].shard for n in sorted(tensor_infos, key=natural_key)}}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return tensor_infos


def _copy_configs(source: _Source, tmp: Path) -> dict[str, Any]:
    """config.json, generation_config.json (derived from config.json when absent), the tokenizer files and
    the loader's extra files; returns the generation defaults the manifest records."""
    model_dir = source.model_dir
    shutil.copy2(model_dir / "config.json", tmp / "config.json")
    gen_defaults = generation_defaults(model_dir)
    if (model_dir / "generation_config.json").is_file():
        shutil.copy2(model_dir / "generation_config.json", tmp / "generation_config.json")
    else:  # a server needs the stop ids; derive them from config.json
        gen_defaults = {k: source.hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                        if source.hf_config.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen_defaults, indent=2) + "\n")
    for name in source.tokenizer.files + [f for f in EXTRA_FILES if (model_dir / f).is_file()]:
        shutil.copy2(model_dir / name, tmp / name)
    return gen_defaults


def _manifest(source: _Source, plan: _Plan, config: BundleConfig, lineage: Lineage,
              tensor_infos: dict[str, TensorInfo], gen_defaults: dict[str, Any], tmp: Path) -> Manifest:
    """The manifest over every file written to `tmp` so far, with the version resolved and lineage filled."""
    files = [FileEntry(p.relative_to(tmp).as_posix(), sha256_file(p), p.stat().st_size)
             for p in sorted(tmp.rglob("*")) if p.is_file()]
    version = config.version
    if version == AUTO_VERSION:
        weights = "".join(f.sha256 for f in files if f.path in plan.shard_names)
        stamp = datetime.now(UTC).strftime("%Y%m%d.%H%M%S")
        version = f"{stamp}-{sha256_bytes(weights.encode())[:8]}"
    resolved_lineage = dataclasses.replace(
        lineage,
        git_commit=lineage.git_commit if lineage.git_commit is not None else _git_commit(),
        source_dir=lineage.source_dir or str(source.model_dir.resolve()),
    )
    arch = source.arch
    return Manifest(
        name=config.name,
        version=version,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        lineage=resolved_lineage,
        architecture=arch,
        tokenizer=source.tokenizer,
        context=ContextContract(max_context=plan.max_context, max_position_embeddings=arch.max_position_embeddings),
        generation_defaults=gen_defaults,
        quantization=source.quant,
        shard_plan=ShardPlan(max_shard_size=plan.max_bytes, shards=plan.shard_names, tensors=tensor_infos,
                             tp=plan.tp),
        files=files,
    )


def math_bytes(dtype: str, shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * DTYPE_BYTES[dtype]


def _write_shard(locations: dict[str, Path], names: list[str], path: Path) -> None:
    """Copy `names` into one safetensors file; tensors keep their dtype and bytes (packed ints included).

    safetensors' torch half loads here, not with the module: the verifier imports this module's helpers in
    processes that never touch a tensor (a server's API process: 1.5 s of CPU and ~200 MB for torch)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    by_source: dict[Path, list[str]] = {}
    for name in names:
        by_source.setdefault(locations[name], []).append(name)
    tensors = {}
    for source, source_names in by_source.items():
        with safe_open(str(source), framework="pt") as handle:
            for name in source_names:
                tensors[name] = handle.get_tensor(name).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


__all__ = ["EVAL_RECORD_FILE", "BundleConfig", "group_shards", "write_bundle"]
