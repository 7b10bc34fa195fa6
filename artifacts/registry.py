"""Bundles as versions of an MLflow registered model, and the way back to a verified local directory.

MLflow 3 quirks this module works around: `register_model('runs:/…')` on a plain artifact
directory fails, so the bundle is logged as run artifacts and registered with
`MlflowClient.create_model_version(name, source=<artifact uri>, run_id=…)`; `search_model_versions`
returns empty aliases, so aliases are read with `get_model_version_by_alias`.

Trust model: the registry is a pointer, not a proof. `resolve_bundle` downloads the version's artifacts,
runs `verify_bundle`, and checks the manifest digest against the digest tagged at registration, so a
swapped artifact store entry is refused as surely as a flipped byte.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from artifacts.adapter_bundle import bundle_digest, is_adapter_bundle, verify_adapter_bundle
from artifacts.common.workdir import sqlite_artifact_root
from artifacts.errors import BundleVerificationError, RegistryError
from artifacts.manifest import MANIFEST_FILE, Manifest, manifest_digest
from artifacts.verify import verify_bundle

BUNDLE_ARTIFACT_PATH = "bundle"
EXPERIMENT_NAME = "bundles"
TAG_DIGEST = "manifest_digest"
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


@dataclass
class ModelVersionRef:
    name: str
    version: str
    run_id: str
    source: str
    manifest_digest: str
    aliases: list[str] = field(default_factory=list)

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def mlflow_client(tracking_uri: str | None):
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def _quant_tag(manifest: Manifest) -> str:
    q = manifest.quantization
    if q is None:
        return "none"
    return f"{q.method}-{q.bits}bit-g{q.group_size}"


def _tags(manifest: Manifest, digest: str) -> dict[str, str]:
    """Short tags only: the MLflow model page shows every version tag in the version's row, where a person
    decides promotions; long lineage goes into the version's description instead."""
    return {
        TAG_DIGEST: digest,
        "bundle_version": manifest.version,
        "quantization": _quant_tag(manifest),
    }


def _description(manifest: Manifest, digest: str, headline: str | None = None) -> str:
    """The version's description (markdown): what it is and where it came from."""
    a, lineage = manifest.architecture, manifest.lineage
    tp = ", ".join(sorted(manifest.shard_plan.tp, key=int))
    git = f" (git {lineage.git_commit})" if lineage.git_commit else ""
    lines = [headline or f"Bundle {manifest.name} {manifest.version}", "",
             f"- model: {a.model_type}, {a.num_layers} layers, hidden {a.hidden_size}, vocab {a.vocab_size}; "
             f"quantization {_quant_tag(manifest)}; tensor-parallel plans {tp}",
             f"- manifest sha256 {digest}",
             f"- base model: {lineage.base_model or '-'}{git}"]
    if lineage.stage_runs:
        runs = ", ".join(f"{k} `{v}`" for k, v in sorted(lineage.stage_runs.items()))
        lines.append(f"- training runs: {runs}")
    if lineage.dataset_digests:
        data = ", ".join(f"{k} `{str(v)[:12]}`" for k, v in sorted(lineage.dataset_digests.items()))
        lines.append(f"- datasets: {data}")
    return "\n".join(lines)


def register_bundle(
    bundle_dir: str | Path,
    model_name: str,
    tracking_uri: str | None = None,
    description: str | None = None,
    aliases: Iterable[str] = (),
) -> ModelVersionRef:
    """Verify, log as artifacts of a run, and create a model version tagged with the manifest digest.

    Logs into the active MLflow run when there is one (and `tracking_uri` is not given); otherwise opens
    and closes a run of its own in the `bundles` experiment."""
    bundle_dir = Path(bundle_dir)
    manifest = verify_bundle(bundle_dir)
    digest = manifest_digest(bundle_dir)
    return log_model_version(
        bundle_dir, [MANIFEST_FILE] + [entry.path for entry in manifest.files], model_name,
        run_name=f"bundle-{manifest.name}-{manifest.version}", digest=digest, tags=_tags(manifest, digest),
        description=_description(manifest, digest, description), model_description=f"Bundles of {manifest.name}",
        aliases=aliases, tracking_uri=tracking_uri)


def log_model_version(bundle_dir: Path, files: list[str], model_name: str, *, run_name: str, digest: str,
                      tags: dict[str, str], description: str, model_description: str,
                      aliases: Iterable[str] = (), tracking_uri: str | None = None) -> ModelVersionRef:
    """Log ``files`` of a verified bundle as a run's artifacts and create a version of ``model_name`` from them
    (a snapshot bundle or an adapter bundle alike; ``tags`` must hold the digest the download is checked by)."""
    from mlflow.exceptions import MlflowException

    client = mlflow_client(tracking_uri)
    try:
        import mlflow

        active = mlflow.active_run() if tracking_uri is None else None
        if active is not None:
            run_id, own_run = active.info.run_id, False
        else:
            experiment = client.get_experiment_by_name(EXPERIMENT_NAME)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(
                EXPERIMENT_NAME, artifact_location=sqlite_artifact_root(tracking_uri or mlflow.get_tracking_uri(),
                                                                        EXPERIMENT_NAME))
            run = client.create_run(experiment_id, run_name=run_name, tags={TAG_DIGEST: digest})
            run_id, own_run = run.info.run_id, True
        artifact_path = BUNDLE_ARTIFACT_PATH if own_run else f"{BUNDLE_ARTIFACT_PATH}-{digest[:12]}"
        # Only the snapshot travels (its manifest + the files it lists); an eval record beside it does not.
        for rel in files:
            parent = Path(rel).parent.as_posix()
            client.log_artifact(run_id, str(bundle_dir / rel),
                                artifact_path=artifact_path if parent == "." else f"{artifact_path}/{parent}")
        if own_run:
            client.set_terminated(run_id)
        source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path}"
        try:
            client.get_registered_model(model_name)
        except MlflowException:
            client.create_registered_model(model_name, description=model_description)
        version = client.create_model_version(model_name, source=source, run_id=run_id, tags=tags,
                                              description=description)
        alias_list = list(aliases)
        for alias in alias_list:
            client.set_registered_model_alias(model_name, alias, version.version)
    except MlflowException as exc:
        raise RegistryError(f"{model_name}: registration failed ({exc.message})") from exc
    return ModelVersionRef(model_name, str(version.version), run_id, source, digest, alias_list)


def set_alias(model_name: str, alias: str, version: str | int, tracking_uri: str | None = None) -> None:
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client(tracking_uri).set_registered_model_alias(model_name, alias, str(version))
    except MlflowException as exc:
        raise RegistryError(f"{model_name}@{alias}: cannot point at version {version} ({exc.message})") from exc


def get_version(uri: str, tracking_uri: str | None = None) -> ModelVersionRef:
    """Look up `models:/name@alias` or `models:/name/N` without downloading anything."""
    from mlflow.exceptions import MlflowException

    match = _MODELS_URI.match(uri)
    if not match:
        raise RegistryError(f"{uri}: not a models:/name@alias or models:/name/version URI")
    name, alias, number = match.group("name"), match.group("alias"), match.group("version")
    client = mlflow_client(tracking_uri)
    try:
        mv = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, number)
    except MlflowException as exc:
        raise RegistryError(f"{uri}: not found in the registry ({exc.message})") from exc
    digest = (mv.tags or {}).get(TAG_DIGEST, "")
    if not digest:
        raise RegistryError(f"{uri}: version {mv.version} has no {TAG_DIGEST} tag (not registered as a bundle)")
    return ModelVersionRef(name, str(mv.version), mv.run_id or "", mv.source, digest, list(mv.aliases or []))


def find_version_by_digest(bundle_dir: str | Path, model_name: str,
                           tracking_uri: str | None = None) -> ModelVersionRef | None:
    """The registered version of ``model_name`` whose manifest digest is this bundle's (a snapshot's or an
    adapter's), if any."""
    from mlflow.exceptions import MlflowException

    digest = bundle_digest(Path(bundle_dir))
    client = mlflow_client(tracking_uri)
    try:
        versions = client.search_model_versions(f"name = '{model_name}'")
    except MlflowException:
        return None
    for mv in sorted(versions, key=lambda v: int(v.version)):
        if (mv.tags or {}).get(TAG_DIGEST) == digest:
            return ModelVersionRef(model_name, str(mv.version), mv.run_id or "", mv.source, digest)
    return None


def resolve_bundle(uri: str | Path, dest_root: str | Path, tracking_uri: str | None = None,
                   tp_degree: int | None = None) -> Path:
    """A verified local bundle directory for a registry URI or a local path.

    Downloads land in `dest_root/<name>/v<version>-<digest12>`; an existing, verifying copy is reused."""
    text = str(uri)
    if not text.startswith("models:/"):
        path = Path(text)
        _verify_local(path, tp_degree)
        return path
    ref = get_version(text, tracking_uri)
    dest = Path(dest_root) / ref.name / f"v{ref.version}-{ref.manifest_digest[:12]}"
    if dest.is_dir():
        try:
            _verify_downloaded(dest, ref, tp_degree)
            return dest
        except (BundleVerificationError, RegistryError):
            shutil.rmtree(dest)  # a damaged cache entry: fetch it again
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.download-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        import mlflow.artifacts

        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=ref.source, dst_path=str(tmp),
                                                         tracking_uri=tracking_uri))
        _verify_downloaded(local, ref, tp_degree)
        try:
            os.rename(local, dest)
        except OSError:  # another process resolved the same version first: use its copy if it verifies
            _verify_downloaded(dest, ref, tp_degree)
    except Exception as exc:
        if isinstance(exc, (BundleVerificationError, RegistryError)):
            raise
        raise RegistryError(f"{text}: download of {ref.source} failed ({exc})") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _verify_local(path: Path, tp_degree: int | None) -> None:
    """A snapshot bundle, or an adapter bundle (verified on its own; against its base where it is served)."""
    if is_adapter_bundle(path):
        verify_adapter_bundle(path)
    else:
        verify_bundle(path, tp_degree)


def _verify_downloaded(path: Path, ref: ModelVersionRef, tp_degree: int | None) -> None:
    _verify_local(path, tp_degree)
    digest = bundle_digest(path)
    if digest != ref.manifest_digest:
        raise RegistryError(f"models:/{ref.name}/{ref.version}: downloaded manifest {digest[:12]} is not the "
                            f"registered {ref.manifest_digest[:12]}")
