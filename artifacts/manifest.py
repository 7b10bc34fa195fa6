"""The bundle manifest: what a server needs to trust a snapshot without trusting whoever built it.

`manifest.json` records where the weights came from (lineage), what they claim to be (architecture,
tokenizer, chat template, quantization), how they are laid out (the shard plan, including per-rank
ownership for tensor parallelism) and the sha256 and size of every file. The verifier recomputes all of
it from the files. The manifest's digest (sha256 of the file's bytes) names the snapshot: the eval record
and the registry tags refer to it.

Every record is a plain dataclass; `to_dict`/`from_dict` map it 1:1 to JSON so an older reader fails on a
schema version it does not know instead of silently misreading a newer manifest.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from artifacts.digests import sha256_file
from artifacts.errors import BundleVerificationError

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
EVAL_RECORD_FILE = "eval_record.json"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class FileEntry:
    """One file of the bundle, path relative to the bundle root."""

    path: str
    sha256: str
    size: int


@dataclass
class Lineage:
    """Where the weights came from: enough to rebuild or audit the snapshot."""

    base_model: str = ""
    base_model_digest: str = ""
    stage_runs: dict[str, str] = field(default_factory=dict)  # stage name -> MLflow run id
    dataset_digests: dict[str, str] = field(default_factory=dict)  # dataset/file name -> sha256
    git_commit: str | None = None
    source_dir: str = ""  # the model dir the bundle was written from (informational)


@dataclass
class ArchitectureSummary:
    model_type: str
    architectures: list[str]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str


@dataclass
class TokenizerInfo:
    digest: str  # digest over the tokenizer files (name -> sha256)
    vocab_size: int  # tokens including added/special tokens
    files: list[str]
    chat_template_digest: str
    chat_template_source: str  # the file the template was read from


@dataclass
class ContextContract:
    """The longest prompt + completion a server may accept for this bundle."""

    max_context: int
    max_position_embeddings: int


@dataclass
class QuantizationInfo:
    method: str  # "gptq" | "awq"
    bits: int
    group_size: int
    calibration_digest: str = ""
    sym: bool | None = None
    desc_act: bool | None = None
    format: str = ""  # checkpoint packing: "gptq", "gptq_v2" (GPTQ) or "gemm" (AWQ)


@dataclass
class TensorInfo:
    shard: str
    dtype: str  # safetensors dtype name: F32, F16, BF16, I32, ...
    shape: list[int]


@dataclass
class TensorSplit:
    """How one tensor is owned under a TP degree.

    kind: "column" / "row" (the Megatron linear splits), "vocab" (embedding rows), "replicate".
    ranges[r] = [start, stop) along `dim` for rank r; empty for "replicate". The ranges partition `dim`,
    except for k/v projections under a degree above the KV head count: ranks that hold the same
    (replicated) KV head hold the same range.
    """

    kind: str
    dim: int | None = None
    ranges: list[list[int]] = field(default_factory=list)


@dataclass
class TPPlan:
    """Ownership under one TP degree. `kv_heads[r]`: the KV heads rank r holds; a head replicated on several
    ranks (degree > num_kv_heads) appears in each of them. None in manifests written before it was recorded."""

    degree: int
    tensors: dict[str, TensorSplit]
    kv_heads: list[list[int]] | None = None


@dataclass
class ShardPlan:
    max_shard_size: int  # bytes
    shards: list[str]
    tensors: dict[str, TensorInfo]  # tensor -> shard, dtype, shape
    tp: dict[str, TPPlan] = field(default_factory=dict)  # str(degree) -> plan

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: info.shard for name, info in self.tensors.items()}


@dataclass
class Manifest:
    name: str
    version: str
    created_at: str
    lineage: Lineage
    architecture: ArchitectureSummary
    tokenizer: TokenizerInfo
    context: ContextContract
    generation_defaults: dict[str, Any]
    quantization: QuantizationInfo | None
    shard_plan: ShardPlan
    files: list[FileEntry]
    schema_version: int = SCHEMA_VERSION

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """Stable text (sorted keys): the same manifest always has the same digest."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BundleVerificationError(
                MANIFEST_FILE, f"schema_version {version!r} is not supported (expected {SCHEMA_VERSION})"
            )
        try:
            plan = data["shard_plan"]
            quant = data.get("quantization")
            return cls(
                name=data["name"],
                version=data["version"],
                created_at=data["created_at"],
                lineage=Lineage(**data["lineage"]),
                architecture=ArchitectureSummary(**data["architecture"]),
                tokenizer=TokenizerInfo(**data["tokenizer"]),
                context=ContextContract(**data["context"]),
                generation_defaults=dict(data["generation_defaults"]),
                quantization=QuantizationInfo(**quant) if quant else None,
                shard_plan=ShardPlan(
                    max_shard_size=plan["max_shard_size"],
                    shards=list(plan["shards"]),
                    tensors={k: TensorInfo(**v) for k, v in plan["tensors"].items()},
                    tp={
                        k: TPPlan(
                            degree=v["degree"],
                            tensors={t: TensorSplit(**s) for t, s in v["tensors"].items()},
                            kv_heads=v.get("kv_heads"),
                        )
                        for k, v in plan.get("tp", {}).items()
                    },
                ),
                files=[FileEntry(**f) for f in data["files"]],
                schema_version=version,
            )
        except (KeyError, TypeError) as exc:
            raise BundleVerificationError(MANIFEST_FILE, f"malformed manifest ({exc!r})") from exc

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BundleVerificationError(MANIFEST_FILE, f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict):
            raise BundleVerificationError(MANIFEST_FILE, "not a JSON object")
        return cls.from_dict(data)


def read_manifest(bundle_dir: str | Path) -> Manifest:
    path = Path(bundle_dir) / MANIFEST_FILE
    if not path.is_file():
        raise BundleVerificationError(MANIFEST_FILE, f"missing in {bundle_dir} (not a bundle, or incomplete)")
    return Manifest.from_json(path.read_text(encoding="utf-8"))


def manifest_digest(bundle_dir: str | Path) -> str:
    """The snapshot's identity: sha256 of manifest.json as written."""
    path = Path(bundle_dir) / MANIFEST_FILE
    if not path.is_file():
        raise BundleVerificationError(MANIFEST_FILE, f"missing in {bundle_dir}")
    return sha256_file(path)
