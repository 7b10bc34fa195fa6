"""The bundle contract for a LoRA adapter: the adapter's files, what base it was trained on, and a verifier that
refuses an adapter whose base does not match.

An adapter is meaningless without the exact base it was trained on: loaded on another base it still runs, and
answers wrongly. So the adapter bundle records the digest of the base bundle's manifest (the base snapshot's
identity), the base's tokenizer and chat-template digests (an adapter is served with the base's tokenizer and
template, so they must be the ones it learned with), and the rank, alpha and targets of the adapter. Files are
PEFT's own (``adapter_config.json``, ``adapter_model.safetensors``), copied verbatim, so the engine and PEFT load
the bundle directory as a plain adapter directory; ``adapter_manifest.json`` lists them with their sha256.

``verify_adapter_bundle(dir, base=BASE)`` checks the files against the manifest, the tensors against the
config's rank and targets and, with a base bundle, the base digest, tokenizer and template digests, and every
tensor's shape against the base's architecture; the first disagreement is a ``BundleVerificationError`` naming
the file and both values.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from artifacts.common.atomic import staged_directory
from artifacts.digests import sha256_file
from artifacts.errors import BundleError, BundleVerificationError
from artifacts.manifest import EVAL_RECORD_FILE, FileEntry, Lineage, Manifest, manifest_digest, read_manifest
from artifacts.safetensors_io import read_header

ADAPTER_MANIFEST = "adapter_manifest.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_SCHEMA_VERSION = 1
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class BaseRef:
    """The base snapshot an adapter was trained on."""

    name: str
    version: str
    manifest_digest: str  # sha256 of the base bundle's manifest.json: its identity
    tokenizer_digest: str
    chat_template_digest: str


@dataclass
class LoraInfo:
    rank: int
    alpha: float
    rslora: bool
    target_modules: list[str]
    layers: int  # how many of the base's layers it adapts


@dataclass
class AdapterManifest:
    name: str
    version: str
    created_at: str
    base: BaseRef
    lora: LoraInfo
    lineage: Lineage
    files: list[FileEntry]
    kind: str = "lora-adapter"
    schema_version: int = ADAPTER_SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdapterManifest:
        if data.get("schema_version") != ADAPTER_SCHEMA_VERSION or data.get("kind") != "lora-adapter":
            raise BundleVerificationError(ADAPTER_MANIFEST, f"kind {data.get('kind')!r}, schema_version "
                                          f"{data.get('schema_version')!r}: not a lora-adapter manifest this "
                                          f"version reads ({ADAPTER_SCHEMA_VERSION})")
        try:
            return cls(name=data["name"], version=data["version"], created_at=data["created_at"],
                       base=BaseRef(**data["base"]), lora=LoraInfo(**data["lora"]),
                       lineage=Lineage(**data["lineage"]), files=[FileEntry(**f) for f in data["files"]],
                       kind=data["kind"], schema_version=data["schema_version"])
        except (KeyError, TypeError) as exc:
            raise BundleVerificationError(ADAPTER_MANIFEST, f"malformed manifest ({exc!r})") from exc


def is_adapter_bundle(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_MANIFEST).is_file()


def bundle_digest(path: Path) -> str:
    """A bundle's identity, what a registered version is tagged with and an eval record is stamped with: the
    sha256 of its manifest (an adapter bundle's own manifest)."""
    return sha256_file(path / ADAPTER_MANIFEST) if is_adapter_bundle(path) else manifest_digest(path)


def read_adapter_manifest(directory: str | Path) -> AdapterManifest:
    path = Path(directory) / ADAPTER_MANIFEST
    if not path.is_file():
        raise BundleVerificationError(ADAPTER_MANIFEST, f"missing in {directory} (not an adapter bundle)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleVerificationError(ADAPTER_MANIFEST, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BundleVerificationError(ADAPTER_MANIFEST, "not a JSON object")
    return AdapterManifest.from_dict(data)


def _lora_info(directory: Path, label_config: str = ADAPTER_CONFIG) -> LoraInfo:
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleVerificationError(label_config, "missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleVerificationError(label_config, f"not valid JSON ({exc})") from None
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise BundleVerificationError(label_config, f"r: a positive integer rank, got {rank!r}")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    unknown = sorted(set(targets) - set(PROJECTIONS))
    if unknown:
        raise BundleVerificationError(label_config, f"target_modules {unknown} are not Llama projections "
                                      f"({', '.join(PROJECTIONS)})")
    tensors = read_header(directory / ADAPTER_WEIGHTS, ADAPTER_WEIGHTS)
    layers = {int(m.group(1)) for key in tensors if (m := _LORA_KEY.search(key))}
    return LoraInfo(rank=rank, alpha=float(config.get("lora_alpha", rank)), rslora=bool(config.get("use_rslora")),
                    target_modules=sorted(targets), layers=len(layers))


def _base_ref(base: Path) -> BaseRef:
    manifest = read_manifest(base)
    return BaseRef(manifest.name, manifest.version, manifest_digest(base), manifest.tokenizer.digest,
                   manifest.tokenizer.chat_template_digest)


def write_adapter_bundle(adapter_dir: str | Path, out_dir: str | Path, base_bundle: str | Path, *, name: str,
                         version: str, lineage: Lineage | None = None) -> Path:
    """Package a PEFT adapter directory, trained on ``base_bundle``, as an adapter bundle at ``out_dir``
    (written beside it and renamed in whole). Raises BundleError naming the file and reason."""
    adapter_dir, out_dir, base_bundle = Path(adapter_dir), Path(out_dir), Path(base_bundle)
    for required in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / required).is_file():
            raise BundleError(f"{adapter_dir / required}: missing (a PEFT adapter saved as safetensors is needed)")
    if out_dir.exists():
        raise BundleError(f"{out_dir}: already exists; not replacing it")
    base = _base_ref(base_bundle)
    lora = _lora_info(adapter_dir)
    with staged_directory(out_dir, if_exists="fail") as tmp:
        files = []
        for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(adapter_dir / file, tmp / file)
            files.append(FileEntry(file, sha256_file(tmp / file), (tmp / file).stat().st_size))
        manifest = AdapterManifest(name, version, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), base, lora,
                                   lineage or Lineage(base_model=f"{base.name}:{base.version}"), files)
        _check_against_base(tmp, manifest, read_manifest(base_bundle))
        (tmp / ADAPTER_MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
    return out_dir


def _check_files(directory: Path, manifest: AdapterManifest) -> None:
    listed = {entry.path for entry in manifest.files}
    for required in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if required not in listed:
            raise BundleVerificationError(required, "not listed in the manifest")
    for entry in manifest.files:
        if not (directory / entry.path).is_file():
            raise BundleVerificationError(entry.path, "missing file (listed in the manifest)")
    for root, _, names in os.walk(directory):
        for file in sorted(names):
            rel = (Path(root) / file).relative_to(directory).as_posix()
            if rel not in listed and rel not in (ADAPTER_MANIFEST, EVAL_RECORD_FILE):  # the record names the digest
                raise BundleVerificationError(rel, "extra file not listed in the manifest")


def _check_lora(directory: Path, manifest: AdapterManifest) -> None:
    found = _lora_info(directory)
    claimed = manifest.lora
    for what in ("rank", "alpha", "rslora", "target_modules", "layers"):
        if getattr(found, what) != getattr(claimed, what):
            raise BundleVerificationError(ADAPTER_CONFIG, f"{what} {getattr(found, what)!r} but the manifest says "
                                          f"{getattr(claimed, what)!r}")


def _check_against_base(directory: Path, manifest: AdapterManifest, base: Manifest) -> None:
    """Every LoRA tensor's shape against the base's architecture: A is [r, in], B is [out, r]."""
    a = base.architecture
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    shapes = {"q_proj": (q, a.hidden_size), "k_proj": (kv, a.hidden_size), "v_proj": (kv, a.hidden_size),
              "o_proj": (a.hidden_size, q), "gate_proj": (a.intermediate_size, a.hidden_size),
              "up_proj": (a.intermediate_size, a.hidden_size), "down_proj": (a.hidden_size, a.intermediate_size)}
    r = manifest.lora.rank
    for key, tensor in read_header(directory / ADAPTER_WEIGHTS, ADAPTER_WEIGHTS).items():
        m = _LORA_KEY.search(key)
        if m is None:
            raise BundleVerificationError(ADAPTER_WEIGHTS, f"tensor {key!r} is not a LoRA weight of a projection")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= a.num_layers:
            raise BundleVerificationError(ADAPTER_WEIGHTS, f"{key}: layer {layer}, but the base "
                                          f"{manifest.base.name}:{manifest.base.version} has {a.num_layers} layers")
        out, inp = shapes[module]
        want = [r, inp] if which == "A" else [out, r]
        if list(tensor.shape) != want:
            raise BundleVerificationError(ADAPTER_WEIGHTS, f"{key}: shape {tensor.shape}, the base's "
                                          f"{module} needs {want} (an adapter of another base?)")


def verify_adapter_bundle(directory: str | Path, base: str | Path | None = None) -> AdapterManifest:
    """Recompute what the adapter manifest claims; with ``base`` (a base bundle), also that it is the base the
    adapter was trained on. Returns the manifest; raises BundleVerificationError on the first disagreement."""
    directory = Path(directory)
    manifest = read_adapter_manifest(directory)
    _check_files(directory, manifest)
    _check_lora(directory, manifest)
    for entry in manifest.files:
        path = directory / entry.path
        if path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
            raise BundleVerificationError(entry.path, "sha256 or size differs from the manifest (changed after "
                                          "it was written)")
    if base is not None:
        check_base(manifest, Path(base))
        _check_against_base(directory, manifest, read_manifest(base))
    return manifest


def check_base(manifest: AdapterManifest, base: Path) -> None:
    """The adapter's recorded base against the base bundle ``base``: manifest, tokenizer and template digests."""
    actual = _base_ref(base)
    claimed = manifest.base
    if actual.manifest_digest != claimed.manifest_digest:
        raise BundleVerificationError(ADAPTER_MANIFEST, f"trained on base {claimed.name}:{claimed.version} (manifest "
                                      f"sha256 {claimed.manifest_digest[:16]}…), but {base} is "
                                      f"{actual.name}:{actual.version} (sha256 {actual.manifest_digest[:16]}…)")
    for what in ("tokenizer_digest", "chat_template_digest"):
        if getattr(actual, what) != getattr(claimed, what):
            raise BundleVerificationError(ADAPTER_MANIFEST, f"{what} {getattr(claimed, what)[:16]}… differs from "
                                          f"the base's {getattr(actual, what)[:16]}…")


def verify_for_serving(adapter: str | Path, served: str | Path) -> AdapterManifest | None:
    """Before a server loads ``adapter``: an adapter bundle is verified, and against the served model when that
    is a bundle (its base must be this very snapshot). A plain PEFT directory carries no base to check (None);
    the engine still checks every tensor's shape against the base it serves."""
    if not is_adapter_bundle(adapter):
        return None
    from artifacts.manifest import MANIFEST_FILE

    base = Path(served) if (Path(served) / MANIFEST_FILE).is_file() else None
    return verify_adapter_bundle(adapter, base=base)


__all__ = ["ADAPTER_MANIFEST", "AdapterManifest", "BaseRef", "LoraInfo", "check_base", "is_adapter_bundle",
           "read_adapter_manifest", "verify_adapter_bundle", "verify_for_serving", "write_adapter_bundle"]
