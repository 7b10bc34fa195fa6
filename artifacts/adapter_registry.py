"""Adapter bundles as versions of their own registered model, with the base version they were trained on.

An adapter is registered under a model of its own (``support-adapter``), so it has its own versions and aliases
(``champion``, ``candidate``, ``canary``) and is promoted without touching the base's. Each version is tagged with
the digest of its adapter manifest (what a download is checked against, as for a snapshot), the digest of the
base bundle's manifest, and, when that base is a registered version of ``base_model``, that version: the lineage
a person reads in the MLflow UI, and what ``deploy`` checks against the base the replicas serve.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from artifacts.adapter_bundle import ADAPTER_MANIFEST, AdapterManifest, verify_adapter_bundle
from artifacts.digests import sha256_file
from artifacts.errors import RegistryError
from artifacts.registry import TAG_DIGEST, ModelVersionRef, log_model_version, mlflow_client

TAG_KIND = "lifecycle.kind"
TAG_BASE_DIGEST = "base_manifest_digest"
TAG_BASE_VERSION = "base_version"
KIND_ADAPTER = "lora-adapter"


def base_version_of(base_digest: str, base_model: str, tracking_uri: str | None = None) -> str | None:
    """The version of ``base_model`` whose manifest digest is ``base_digest`` (None: not registered there)."""
    from mlflow.exceptions import MlflowException

    try:
        versions = mlflow_client(tracking_uri).search_model_versions(f"name = '{base_model}'")
    except MlflowException:
        return None
    found = [mv for mv in versions if (mv.tags or {}).get(TAG_DIGEST) == base_digest]
    return str(min(int(mv.version) for mv in found)) if found else None


def _description(manifest: AdapterManifest, digest: str, base_model: str, base_version: str | None) -> str:
    lora, base = manifest.lora, manifest.base
    on = f"{base_model} version {base_version}" if base_version else f"bundle {base.name} {base.version}"
    lines = [f"LoRA adapter {manifest.name} {manifest.version}, on {on}", "",
             f"- rank {lora.rank}, alpha {lora.alpha:g}{' (rsLoRA)' if lora.rslora else ''}, "
             f"{', '.join(lora.target_modules)} in {lora.layers} layers",
             f"- adapter manifest sha256 {digest}",
             f"- base manifest sha256 {base.manifest_digest}"]
    if manifest.lineage.stage_runs:
        runs = ", ".join(f"{k} `{v}`" for k, v in sorted(manifest.lineage.stage_runs.items()))
        lines.append(f"- training runs: {runs}")
    return "\n".join(lines)


def register_adapter_bundle(bundle_dir: str | Path, model_name: str, *, base_model: str,
                            tracking_uri: str | None = None, aliases: Iterable[str] = (),
                            require_base: bool = True) -> ModelVersionRef:
    """Verify the adapter bundle and register it as a version of ``model_name``, with its base's version.

    ``require_base``: refuse an adapter whose base is not a registered version of ``base_model`` (RegistryError
    naming the digest), so no adapter enters the registry without the base it needs to be served on."""
    bundle_dir = Path(bundle_dir)
    manifest = verify_adapter_bundle(bundle_dir)
    if model_name == base_model:
        raise RegistryError(f"{model_name}: an adapter is registered under a model of its own, not its base's")
    base_version = base_version_of(manifest.base.manifest_digest, base_model, tracking_uri)
    if base_version is None and require_base:
        raise RegistryError(f"{bundle_dir}: its base (manifest {manifest.base.manifest_digest[:12]}, bundle "
                            f"{manifest.base.name} {manifest.base.version}) is not a registered version of "
                            f"{base_model}; register the base first")
    digest = sha256_file(bundle_dir / ADAPTER_MANIFEST)
    tags = {TAG_DIGEST: digest, TAG_KIND: KIND_ADAPTER, "bundle_version": manifest.version,
            TAG_BASE_DIGEST: manifest.base.manifest_digest, "base_model": base_model,
            TAG_BASE_VERSION: base_version or "", "lora_rank": str(manifest.lora.rank)}
    return log_model_version(
        bundle_dir, [ADAPTER_MANIFEST] + [entry.path for entry in manifest.files], model_name,
        run_name=f"adapter-{manifest.name}-{manifest.version}", digest=digest, tags=tags,
        description=_description(manifest, digest, base_model, base_version),
        model_description=f"LoRA adapters {manifest.name} on {base_model}", aliases=aliases,
        tracking_uri=tracking_uri)


def adapter_base(model_name: str, version: str, tracking_uri: str | None = None) -> tuple[str, str, str]:
    """(base model, base version, base manifest digest) a registered adapter version was trained on."""
    from mlflow.exceptions import MlflowException

    try:
        mv = mlflow_client(tracking_uri).get_model_version(model_name, version)
    except MlflowException as exc:
        raise RegistryError(f"models:/{model_name}/{version}: not found ({exc.message})") from exc
    tags = mv.tags or {}
    if tags.get(TAG_KIND) != KIND_ADAPTER:
        raise RegistryError(f"models:/{model_name}/{version}: not an adapter version ({TAG_KIND} is "
                            f"{tags.get(TAG_KIND)!r})")
    return tags.get("base_model", ""), tags.get(TAG_BASE_VERSION, ""), tags.get(TAG_BASE_DIGEST, "")
