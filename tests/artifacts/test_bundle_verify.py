"""Tamper tests: each way a bundle can be damaged is refused with a one-line `<file>: <reason>`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from artifacts.errors import BundleVerificationError, LifecycleError
from artifacts.manifest import INDEX_FILE, read_manifest
from artifacts.verify import verify_bundle


def _refused(bundle: Path, pattern: str, tp_degree: int | None = None) -> str:
    with pytest.raises(BundleVerificationError, match=pattern) as info:
        verify_bundle(bundle, tp_degree=tp_degree)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, LifecycleError)
    return message


def _largest_shard(bundle: Path) -> Path:
    shards = read_manifest(bundle).shard_plan.shards
    return max((bundle / s for s in shards), key=lambda p: p.stat().st_size)


def test_clean_bundle_verifies(session_bundle):
    manifest = verify_bundle(session_bundle, tp_degree=2)
    assert manifest.name == "tiny" and manifest.version == "1.0.0"


def test_flipped_byte_is_a_checksum_mismatch(bundle):
    shard = _largest_shard(bundle)
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01  # inside the tensor data: the header still parses
    shard.write_bytes(bytes(data))
    message = _refused(bundle, "sha256 mismatch")
    assert message.startswith(f"{shard.name}: ")


def test_deleted_shard(bundle):
    shard = _largest_shard(bundle)
    shard.unlink()
    assert _refused(bundle, "missing shard").startswith(shard.name)


def test_unknown_shard_in_weight_map(bundle, refresh_manifest):
    index = json.loads((bundle / INDEX_FILE).read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "model-00099-of-00099.safetensors"
    (bundle / INDEX_FILE).write_text(json.dumps(index))
    refresh_manifest(bundle)
    message = _refused(bundle, "model-00099-of-00099.safetensors, which is not a shard")
    assert message.startswith(f"{INDEX_FILE}: ")


def test_extra_file_not_in_manifest(bundle):
    (bundle / "model-00099-of-00099.safetensors").write_bytes(b"\0" * 16)
    _refused(bundle, r"^model-00099-of-00099.safetensors: extra file not listed")


def test_tokenizer_from_another_model(bundle, refresh_manifest, foreign_tokenizer):
    """A tokenizer larger than the embedding is refused, even with the checksums fixed up."""
    import shutil

    rows = read_manifest(bundle).shard_plan.tensors["model.embed_tokens.weight"].shape[0]
    other = foreign_tokenizer(rows)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(other / name, bundle / name)
    refresh_manifest(bundle)
    message = _refused(bundle, rf"^tokenizer.json: tokenizer has \d+ tokens but the embedding has {rows} rows")
    assert "another model" in message


def test_swapped_tokenizer_without_fixing_checksums(bundle, foreign_tokenizer):
    import shutil

    rows = read_manifest(bundle).shard_plan.tensors["model.embed_tokens.weight"].shape[0]
    shutil.copy2(foreign_tokenizer(rows) / "tokenizer.json", bundle / "tokenizer.json")
    _refused(bundle, "^tokenizer.json: ")


def test_truncated_safetensors(bundle):
    shard = _largest_shard(bundle)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    assert _refused(bundle, "truncated safetensors file").startswith(shard.name)


def test_tp_degree_that_does_not_divide(session_bundle):
    # 4 attention heads: vLLM (and the plan) cannot split them over 3 ranks.
    assert _refused(session_bundle, "tp degree 3", tp_degree=3) == \
        "config.json: tp degree 3: num_attention_heads = 4 is not divisible by 3"


def test_tp_degree_above_kv_heads_verifies(session_bundle):
    """2 KV heads over 4 ranks: each KV head replicated on 2 ranks, as vLLM serves it (refused before)."""
    assert read_manifest(session_bundle).architecture.num_kv_heads == 2
    verify_bundle(session_bundle, tp_degree=4)


def test_recorded_kv_head_ownership_is_checked(bundle, refresh_manifest):
    def swap(data):
        data["shard_plan"]["tp"]["2"]["kv_heads"] = [[1], [0]]

    refresh_manifest(bundle, swap)
    assert _refused(bundle, "kv_heads") == \
        "manifest.json: shard_plan.tp[2].kv_heads = [[1], [0]] but the model's heads give [[0], [1]]"


def test_manifest_written_before_kv_heads_were_recorded_verifies(bundle, refresh_manifest):
    def drop(data):
        for plan in data["shard_plan"]["tp"].values():
            del plan["kv_heads"]

    refresh_manifest(bundle, drop)
    assert read_manifest(bundle).shard_plan.tp["2"].kv_heads is None
    verify_bundle(bundle, tp_degree=4)


def test_chat_template_that_fails_to_render(bundle, refresh_manifest):
    manifest = read_manifest(bundle)
    source = manifest.tokenizer.chat_template_source
    broken = "{% for message in messages %}{{ message['content'] }"  # unclosed block
    if source == "chat_template.jinja":
        (bundle / source).write_text(broken)
    else:
        config = json.loads((bundle / source).read_text())
        config["chat_template"] = broken
        (bundle / source).write_text(json.dumps(config))
    refresh_manifest(bundle)
    assert _refused(bundle, "chat template fails to render").startswith(f"{source}: ")


def test_unsupported_quantization_format(bundle, refresh_manifest):
    config = json.loads((bundle / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitnet", "bits": 1}
    (bundle / "config.json").write_text(json.dumps(config))
    refresh_manifest(bundle)
    _refused(bundle, r"^config.json: unsupported quantization format quant_method='bitnet'")


def test_tensor_shape_against_config(bundle, refresh_manifest):
    config = json.loads((bundle / "config.json").read_text())
    config["intermediate_size"] *= 2
    (bundle / "config.json").write_text(json.dumps(config))
    refresh_manifest(bundle, lambda m: m["architecture"].update(intermediate_size=config["intermediate_size"]))
    _refused(bundle, r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight: shape \[.*\] does not match config\.json")


def test_tensor_dtype_against_config(bundle, refresh_manifest):
    config = json.loads((bundle / "config.json").read_text())
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    other = "bfloat16" if declared != "bfloat16" else "float32"
    config["dtype"] = other
    config.pop("torch_dtype", None)
    (bundle / "config.json").write_text(json.dumps(config))
    refresh_manifest(bundle, lambda m: m["architecture"].update(dtype=other))
    _refused(bundle, r"tensor model\.\S+: dtype \w+ does not match")


def test_manifest_edit_without_files_is_caught(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["architecture"]["num_layers"] += 1
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    _refused(bundle, r"^manifest.json: architecture.num_layers")


def test_unknown_schema_version(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    _refused(bundle, r"^manifest.json: schema_version 99 is not supported")


def test_not_a_bundle(tmp_path):
    _refused(tmp_path, r"^manifest.json: missing")


def test_eval_record_is_not_part_of_the_snapshot(bundle):
    (bundle / "eval_record.json").write_text("{}")
    verify_bundle(bundle)


def test_errors_survive_pickling_with_their_fields():
    """Prefect may carry a failed task's exception across processes."""
    import pickle

    from artifacts.shard_plan import TPDegreeError

    error = pickle.loads(pickle.dumps(BundleVerificationError("config.json", "bad\nvalue")))
    assert (error.file, error.reason, str(error)) == ("config.json", "bad value", "config.json: bad value")
    tp_error = pickle.loads(pickle.dumps(TPDegreeError("tp degree 3: x", tensor="w")))
    assert (str(tp_error), tp_error.tensor) == ("tp degree 3: x", "w")


def test_file_dropped_from_disk_and_manifest(bundle, refresh_manifest):
    """An attacker who removes config.json and its manifest entry still gets a one-line refusal."""
    (bundle / "config.json").unlink()
    refresh_manifest(bundle, lambda m: m.update(files=[f for f in m["files"] if f["path"] != "config.json"]))
    _refused(bundle, "^config.json: missing")
