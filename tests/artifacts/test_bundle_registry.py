"""Registry round trip on a real MLflow store (sqlite + local artifact root in tmp), no mocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from artifacts.errors import BundleVerificationError, RegistryError
from artifacts.eval_record import write_eval_record
from artifacts.manifest import manifest_digest
from artifacts.registry import EXPERIMENT_NAME, get_version, register_bundle, resolve_bundle, set_alias


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store per module (creating MLflow's tables costs seconds); cwd in tmp so no ./mlruns leaks."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        MlflowClient(uri).create_experiment(EXPERIMENT_NAME, artifact_location=(root / "artifacts").as_uri())
        yield uri, root


@pytest.fixture(scope="module")
def registered(store, session_bundle):
    uri, _ = store
    return register_bundle(session_bundle, "tiny-model", tracking_uri=uri, aliases=["champion"])


def test_register_resolve_by_alias_verify_load(store, registered, session_bundle, tmp_path):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    uri, _ = store
    digest = manifest_digest(session_bundle)
    assert registered.manifest_digest == digest and registered.version == "1"
    mv = MlflowClient(uri).get_model_version_by_alias("tiny-model", "champion")
    assert mv.tags["manifest_digest"] == digest and mv.tags["quantization"] == "none"
    assert "base model: micro" in mv.description and "run-sft" in mv.description  # lineage: not a tag
    assert digest in mv.description
    assert all(len(value) <= 64 for value in mv.tags.values())  # short tags: the model page stays readable

    local = resolve_bundle("models:/tiny-model@champion", tmp_path / "cache", tracking_uri=uri)
    assert local.is_relative_to(tmp_path / "cache") and manifest_digest(local) == digest
    model = AutoModelForCausalLM.from_pretrained(str(local), device_map="cpu")
    tokenizer = AutoTokenizer.from_pretrained(str(local))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    # a second resolve reuses the verified copy
    assert resolve_bundle("models:/tiny-model/1", tmp_path / "cache", tracking_uri=uri) == local


def test_alias_moves_between_versions(store, registered, bundle, tmp_path):
    uri, _ = store
    write_eval_record(bundle, metrics={"acc": 1.0})  # beside the bundle, not part of the version
    second = register_bundle(bundle, "tiny-model", tracking_uri=uri, description="candidate")
    assert int(second.version) == int(registered.version) + 1
    set_alias("tiny-model", "canary", second.version, tracking_uri=uri)
    ref = get_version("models:/tiny-model@canary", tracking_uri=uri)
    assert ref.version == second.version and "canary" in ref.aliases
    local = resolve_bundle("models:/tiny-model@canary", tmp_path / "cache", tracking_uri=uri)
    assert not (local / "eval_record.json").exists()
    assert get_version("models:/tiny-model@champion", tracking_uri=uri).version == registered.version


def test_unknown_alias_and_bad_uri(store, registered, tmp_path):
    uri, _ = store
    with pytest.raises(RegistryError, match="models:/tiny-model@nope: not found"):
        resolve_bundle("models:/tiny-model@nope", tmp_path, tracking_uri=uri)
    with pytest.raises(RegistryError, match="not a models:/name@alias"):
        get_version("models:/tiny-model", tracking_uri=uri)
    with pytest.raises(RegistryError, match="cannot point at version 99"):
        set_alias("tiny-model", "x", 99, tracking_uri=uri)


def test_tampered_artifact_store_is_refused(store, registered, tmp_path):
    from urllib.parse import urlparse

    uri, _ = store
    stored = Path(urlparse(registered.source).path)
    shard = min(stored.glob("model-00001-of-*.safetensors"))
    original = shard.read_bytes()
    try:
        data = bytearray(original)
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(BundleVerificationError, match="sha256 mismatch"):
            resolve_bundle(f"models:/tiny-model/{registered.version}", tmp_path / "fresh", tracking_uri=uri)
        assert not any((tmp_path / "fresh").rglob("manifest.json"))  # nothing half-trusted left behind
    finally:
        shard.write_bytes(original)


def test_refuses_to_register_a_broken_bundle(store, bundle):
    uri, _ = store
    (bundle / "config.json").write_text("{}")
    with pytest.raises(BundleVerificationError):
        register_bundle(bundle, "tiny-model", tracking_uri=uri)


def test_register_inside_the_active_run(store, session_bundle, tmp_path):
    """The pipeline registers from inside its stage run: artifacts land in that run, not a new one."""
    import mlflow

    uri, _ = store
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(experiment_id=mlflow.get_experiment_by_name(EXPERIMENT_NAME).experiment_id) as run:
            ref = register_bundle(session_bundle, "tiny-pipeline", aliases=["candidate"])
        assert ref.run_id == run.info.run_id
        assert f"/{run.info.run_id}/" in ref.source
        local = resolve_bundle("models:/tiny-pipeline@candidate", tmp_path / "cache")
        assert manifest_digest(local) == manifest_digest(session_bundle)
    finally:
        mlflow.set_tracking_uri(previous)
