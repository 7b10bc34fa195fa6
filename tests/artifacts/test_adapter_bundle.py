"""Adapter bundles (issue 33, item 3): a PEFT LoRA adapter packaged with the identity of the base bundle it was
trained on; `bundle verify ADAPTER --base BASE` refuses an adapter of another base, naming both digests, and
`lifecycle serve BASE --lora-modules NAME=ADAPTER` refuses it before anything loads.

The adapters are real PEFT adapters of the tiny base (``save_pretrained``); the second base is the same shape
with other weights, so only the recorded digest can tell the two apart.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from artifacts.adapter_bundle import (
    ADAPTER_MANIFEST,
    read_adapter_manifest,
    verify_adapter_bundle,
    write_adapter_bundle,
)
from artifacts.cli import main
from artifacts.errors import BundleError, BundleVerificationError
from artifacts.manifest import Lineage, manifest_digest
from artifacts.writer import BundleConfig, write_bundle
from tests.artifacts.conftest import build_tiny_llama
from tests.lora_support import make_adapter


def peft_adapter(base_dir: Path, out: Path) -> Path:
    return make_adapter(base_dir, out, rank=4, targets=("q_proj", "v_proj"), seed=0, alpha=8, scale=0.0)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Two base bundles of the same shape: ``a`` (seed 0) and ``b`` (other weights)."""
    root = tmp_path_factory.mktemp("adapter-bases")
    a_dir = build_tiny_llama(root / "a-model")
    b_dir = build_tiny_llama(root / "b-model")
    from safetensors.torch import load_file, save_file

    weights = load_file(b_dir / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, b_dir / "model.safetensors", metadata={"format": "pt"})
    return {name: write_bundle(d, root / f"{name}-bundle", BundleConfig(name=f"base-{name}", version="1"),
                               Lineage(base_model="tiny")) for name, d in (("a", a_dir), ("b", b_dir))}


@pytest.fixture(scope="module")
def adapter_bundle(bases, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapter")
    plain = peft_adapter(bases["a"], root / "plain")
    return write_adapter_bundle(plain, root / "bundle", bases["a"], name="support", version="3")


def test_an_adapter_bundle_records_its_base_and_verifies_against_it(adapter_bundle, bases, capsys):
    manifest = read_adapter_manifest(adapter_bundle)
    assert manifest.base.manifest_digest == manifest_digest(bases["a"])
    assert manifest.lora.rank == 4 and manifest.lora.target_modules == ["q_proj", "v_proj"]
    assert manifest.lora.layers == 2
    assert sorted(f.path for f in manifest.files) == ["adapter_config.json", "adapter_model.safetensors"]
    assert verify_adapter_bundle(adapter_bundle, base=bases["a"]).name == "support"
    assert main(["bundle", "verify", str(adapter_bundle), "--base", str(bases["a"])]) == 0
    out = capsys.readouterr().out
    assert "verified adapter" in out and manifest_digest(bases["a"]) in out


def test_an_adapter_of_another_base_is_refused_naming_both_digests(adapter_bundle, bases, capsys):
    with pytest.raises(BundleVerificationError) as caught:
        verify_adapter_bundle(adapter_bundle, base=bases["b"])
    message = str(caught.value)
    assert message.startswith(f"{ADAPTER_MANIFEST}: trained on base base-a:1")
    assert manifest_digest(bases["a"])[:16] in message and manifest_digest(bases["b"])[:16] in message
    assert main(["bundle", "verify", str(adapter_bundle), "--base", str(bases["b"])]) == 2
    assert capsys.readouterr().err.strip().startswith("error: adapter_manifest.json: trained on base base-a:1")


def test_a_changed_or_extra_file_is_named(adapter_bundle, tmp_path):
    tampered = Path(shutil.copytree(adapter_bundle, tmp_path / "tampered"))
    weights = tampered / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleVerificationError, match="adapter_model.safetensors: sha256 or size differs"):
        verify_adapter_bundle(tampered)
    extra = Path(shutil.copytree(adapter_bundle, tmp_path / "extra"))
    (extra / "notes.txt").write_text("hi")
    with pytest.raises(BundleVerificationError, match="notes.txt: extra file not listed"):
        verify_adapter_bundle(extra)
    edited = Path(shutil.copytree(adapter_bundle, tmp_path / "edited"))
    config = json.loads((edited / "adapter_config.json").read_text())
    (edited / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 64}))
    with pytest.raises(BundleVerificationError, match="adapter_config.json: alpha 64.0 but the manifest says 8.0"):
        verify_adapter_bundle(edited)


def test_an_adapter_shaped_for_another_architecture_cannot_be_written(bases, tmp_path):
    wider = build_tiny_llama(tmp_path / "wider", hidden_size=96, intermediate_size=192)
    plain = peft_adapter(wider, tmp_path / "wider-adapter")
    with pytest.raises(BundleVerificationError, match=r"q_proj\.lora_A\.weight: shape \[4, 96\], the base's q_proj "
                                                      r"needs \[4, 64\]"):
        write_adapter_bundle(plain, tmp_path / "out", bases["a"], name="wide", version="1")
    assert not (tmp_path / "out").exists()  # nothing half-written under the target's name
    with pytest.raises(BundleError, match="adapter_config.json: missing"):
        write_adapter_bundle(tmp_path, tmp_path / "out2", bases["a"], name="none", version="1")


def test_serve_refuses_an_adapter_bundle_of_another_base_before_loading(adapter_bundle, bases):
    from serving.cli import ServeError, add_serve_arguments, lora_modules

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    good = parser.parse_args([str(bases["a"]), "--lora-modules", f"support={adapter_bundle}"])
    assert lora_modules(good) == {"support": str(adapter_bundle)}
    bad = parser.parse_args([str(bases["b"]), "--lora-modules", f"support={adapter_bundle}"])
    with pytest.raises(ServeError, match=r"--lora-modules: support=.*: adapter_manifest.json: trained on base "
                                         r"base-a:1 .* but .* is base-b:1"):
        lora_modules(bad)


def test_an_adapter_registers_as_its_own_model_with_its_base_version_and_downloads_verified(
        adapter_bundle, bases, tmp_path, monkeypatch):
    """Registered in a real sqlite MLflow store: refused while its base is not a registered version, then a
    version of `support-adapter` tagged with the base's version; `models:/support-adapter/1` resolves to a verified
    copy, and a copy whose adapter manifest was swapped is refused."""
    from mlflow import MlflowClient

    from artifacts.adapter_registry import adapter_base, register_adapter_bundle
    from artifacts.errors import RegistryError
    from artifacts.registry import register_bundle, resolve_bundle

    monkeypatch.chdir(tmp_path)  # the registration runs' artifacts land here
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(RegistryError, match="is not a registered version of base-a; register the base first"):
        register_adapter_bundle(adapter_bundle, "support-adapter", base_model="base-a", tracking_uri=uri)
    register_bundle(bases["b"], "base-a", tracking_uri=uri)  # another base under that name: still not its base
    with pytest.raises(RegistryError, match="register the base first"):
        register_adapter_bundle(adapter_bundle, "support-adapter", base_model="base-a", tracking_uri=uri)
    base = register_bundle(bases["a"], "base-a", tracking_uri=uri)
    with pytest.raises(RegistryError, match="a model of its own"):
        register_adapter_bundle(adapter_bundle, "base-a", base_model="base-a", tracking_uri=uri)
    ref = register_adapter_bundle(adapter_bundle, "support-adapter", base_model="base-a", tracking_uri=uri,
                                  aliases=("champion",))
    assert (ref.version, ref.aliases) == ("1", ["champion"])
    assert adapter_base("support-adapter", "1", uri) == ("base-a", base.version, manifest_digest(bases["a"]))
    version = MlflowClient(uri).get_model_version("support-adapter", "1")
    assert f"on base-a version {base.version}" in version.description and version.tags["lora_rank"] == "4"
    with pytest.raises(RegistryError, match="not an adapter version"):
        adapter_base("base-a", base.version, uri)
    local = resolve_bundle("models:/support-adapter@champion", tmp_path / "deployments", tracking_uri=uri)
    assert verify_adapter_bundle(local, base=bases["a"]).version == "3"
    manifest = json.loads((local / ADAPTER_MANIFEST).read_text())
    manifest["version"] = "4"  # a cached copy someone edited: it no longer is the registered adapter
    (local / ADAPTER_MANIFEST).write_text(json.dumps(manifest))
    again = resolve_bundle("models:/support-adapter/1", tmp_path / "deployments", tracking_uri=uri)
    assert again == local and read_adapter_manifest(again).version == "3"  # the damaged copy was fetched again
