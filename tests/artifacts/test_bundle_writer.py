"""The writer: HF layout, re-sharding, verbatim tensors, atomic write, refusals, and loading the result."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from artifacts.errors import BundleError
from artifacts.manifest import INDEX_FILE, QuantizationInfo, read_manifest
from artifacts.safetensors_io import source_weight_files
from artifacts.verify import verify_bundle
from artifacts.writer import BundleConfig, group_shards, write_bundle


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    result = {}
    for name, file in source_weight_files(directory).items():
        with safe_open(str(file), framework="pt") as handle:
            result[name] = handle.get_tensor(name)
    return result


def test_bundle_has_hf_layout_and_is_sharded(session_bundle, model_dir):
    manifest = read_manifest(session_bundle)
    names = {p.name for p in session_bundle.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", INDEX_FILE,
            "manifest.json"} <= names
    assert len(manifest.shard_plan.shards) >= 3
    index = json.loads((session_bundle / INDEX_FILE).read_text())
    assert index["weight_map"] == manifest.shard_plan.weight_map
    assert set(index["weight_map"].values()) == set(manifest.shard_plan.shards)
    listed = {f.path for f in manifest.files}
    assert listed == names - {"manifest.json"}
    assert manifest.lineage.stage_runs["sft"] == "run-sft"
    assert manifest.tokenizer.vocab_size <= manifest.architecture.vocab_size
    assert manifest.context.max_context == manifest.architecture.max_position_embeddings
    assert manifest.generation_defaults.get("eos_token_id")
    assert set(manifest.shard_plan.tp) == {"1", "2"}


def test_tensors_are_copied_bit_for_bit(session_bundle, model_dir):
    source, bundled = _tensors(model_dir), _tensors(session_bundle)
    assert source.keys() == bundled.keys()
    for name, tensor in source.items():
        assert bundled[name].dtype == tensor.dtype
        assert torch.equal(bundled[name], tensor), name


def test_shard_grouping_respects_the_limit():
    sizes = {"model.layers.10.w": 40, "model.layers.2.w": 40, "model.layers.1.w": 40, "big": 500}
    groups = group_shards(sizes, 100)
    assert groups[0] == ["big"]  # an oversized tensor gets a shard of its own
    assert [n for g in groups for n in g][1:] == ["model.layers.1.w", "model.layers.2.w", "model.layers.10.w"]
    assert all(sum(sizes[n] for n in g) <= 100 for g in groups[1:])
    with pytest.raises(ValueError, match="max_shard_size: cannot parse size 'lots'"):
        BundleConfig(name="m", max_shard_size="lots")


def test_config_validation():
    with pytest.raises(ValueError, match="tp_degrees"):
        BundleConfig(name="x", tp_degrees=[0])
    with pytest.raises(ValueError, match="name"):
        BundleConfig(name="../evil")
    with pytest.raises(ValueError, match="max_context"):
        BundleConfig(name="x", max_context=0)


def test_refuses_to_overwrite_a_complete_bundle(session_bundle, model_dir, lineage):
    with pytest.raises(BundleError, match="already exists"):
        write_bundle(model_dir, session_bundle, BundleConfig(name="tiny"), lineage)
    verify_bundle(session_bundle)


def test_interrupted_build_leaves_nothing_that_looks_complete(model_dir, lineage, tmp_path, monkeypatch,
                                                              small_shard_size):
    from artifacts import writer

    real, calls = writer._write_shard, []

    def crash_on_second_shard(*args):  # fault injected on purpose
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(writer, "_write_shard", crash_on_second_shard)
    out = tmp_path / "bundle"
    with pytest.raises(KeyboardInterrupt):
        write_bundle(model_dir, out, BundleConfig(name="tiny", max_shard_size=small_shard_size), lineage)
    assert not out.exists()
    assert os.listdir(tmp_path) == []


def test_refuses_model_without_chat_template(model_dir, lineage, tmp_path):
    import shutil

    source = Path(shutil.copytree(model_dir, tmp_path / "src"))
    (source / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(BundleError, match="no chat_template"):
        write_bundle(source, tmp_path / "out", BundleConfig(name="tiny"), lineage)
    assert not (tmp_path / "out").exists()


def test_refuses_tp_degree_that_does_not_fit(model_dir, lineage, tmp_path):
    with pytest.raises(BundleError, match="tp degree 3: .* not divisible by 3"):
        write_bundle(model_dir, tmp_path / "out", BundleConfig(name="tiny", tp_degrees=[1, 3]), lineage)


def test_fp_bundle_loads_with_transformers_and_generates(session_bundle, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bundled = AutoModelForCausalLM.from_pretrained(str(session_bundle), device_map="cpu")
    source = AutoModelForCausalLM.from_pretrained(str(model_dir), device_map="cpu")
    tokenizer = AutoTokenizer.from_pretrained(str(session_bundle))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 + 3?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        assert torch.equal(bundled(**ids).logits, source(**ids).logits)
        out = bundled.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(out[0, ids["input_ids"].shape[1]:]), str)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantized_tensors_copied_verbatim_and_checked(method, model_dir, make_quantized, lineage, tmp_path):
    qdir = make_quantized(model_dir, tmp_path / f"{method}-src", method=method)
    out = write_bundle(qdir, tmp_path / "bundle", BundleConfig(name="tiny-q", max_shard_size="50KB"), lineage,
                       quantization=QuantizationInfo(method=method, bits=4, group_size=32,
                                                     calibration_digest="cd" * 32))
    manifest = verify_bundle(out)
    q = manifest.quantization
    assert (q.method, q.bits, q.group_size, q.calibration_digest) == (method, 4, 32, "cd" * 32)
    source, bundled = _tensors(qdir), _tensors(out)
    packed = [n for n in source if n.endswith(".qweight")]
    assert packed and source.keys() == bundled.keys()
    for name in source:
        assert bundled[name].dtype == source[name].dtype and torch.equal(bundled[name], source[name])
    assert bundled[packed[0]].dtype == torch.int32
    split = manifest.shard_plan.tp["2"].tensors
    assert split["model.layers.0.self_attn.q_proj.qweight"].dim == 1  # packed [in, out]: column split on out
    assert split["model.layers.0.self_attn.o_proj.qweight"].dim == 0  # row split on in


def test_quantized_shapes_must_match_bits_and_group_size(model_dir, make_quantized, lineage, tmp_path):
    qdir = make_quantized(model_dir, tmp_path / "src", method="gptq", group_size=32)
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["group_size"] = 16  # claims g16, tensors are packed for g32
    (qdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(BundleError, match=r"qzeros: shape .* group_size 16"):
        write_bundle(qdir, tmp_path / "out", BundleConfig(name="q"), lineage)
    with pytest.raises(BundleError, match="disagrees"):
        write_bundle(qdir, tmp_path / "out", BundleConfig(name="q"), lineage,
                     quantization=QuantizationInfo(method="gptq", bits=8, group_size=16))


def test_unsupported_quantization_refused(model_dir, make_quantized, lineage, tmp_path):
    qdir = make_quantized(model_dir, tmp_path / "src", method="awq")
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (qdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(BundleError, match="unsupported quantization format awq/gemv"):
        write_bundle(qdir, tmp_path / "out", BundleConfig(name="q"), lineage)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantized_bundle_loads_with_transformers_and_generates(method, real_quantized_dirs, lineage, tmp_path):
    """A real gptqmodel checkpoint, bundled and sharded, loads with plain transformers and matches its source."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = real_quantized_dirs[method]
    out = write_bundle(source, tmp_path / "bundle", BundleConfig(name=f"q-{method}", max_shard_size="100KB"),
                       lineage)
    manifest = verify_bundle(out, tp_degree=2)
    assert manifest.quantization.method == method and manifest.quantization.bits == 4
    assert len(manifest.shard_plan.shards) > 1
    assert torch.equal(_tensors(out)["model.layers.0.mlp.down_proj.qweight"],
                       _tensors(source)["model.layers.0.mlp.down_proj.qweight"])
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 + 3?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    dtype = torch.float32 if method == "gptq" else torch.float16  # AWQ's torch kernel runs in half precision
    bundled = AutoModelForCausalLM.from_pretrained(str(out), device_map="cpu", dtype=dtype)
    original = AutoModelForCausalLM.from_pretrained(str(source), device_map="cpu", dtype=dtype)
    with torch.no_grad():
        assert torch.equal(bundled(**ids).logits, original(**ids).logits)
        out_ids = bundled.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out_ids.shape[1] > ids["input_ids"].shape[1]


def test_untied_lm_head_is_bundled_and_vocab_split(untied_model_dir, lineage, tmp_path):
    from transformers import AutoModelForCausalLM

    out = write_bundle(untied_model_dir, tmp_path / "b", BundleConfig(name="untied", max_shard_size="60KB"),
                       lineage)
    manifest = verify_bundle(out, tp_degree=2)
    assert "lm_head.weight" in manifest.shard_plan.tensors
    vocab = manifest.architecture.vocab_size
    split = manifest.shard_plan.tp["2"].tensors["lm_head.weight"]
    assert (split.kind, split.ranges) == (("vocab", [[0, vocab // 2], [vocab // 2, vocab]]) if vocab % 2 == 0
                                          else ("replicate", []))
    source = AutoModelForCausalLM.from_pretrained(str(untied_model_dir), device_map="cpu")
    bundled = AutoModelForCausalLM.from_pretrained(str(out), device_map="cpu")
    ids = torch.tensor([[0, 5, 9, 11]])
    with torch.no_grad():
        assert torch.equal(bundled(ids).logits, source(ids).logits)
