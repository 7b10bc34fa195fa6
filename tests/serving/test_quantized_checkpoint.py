"""GPTQ/AWQ checkpoints read from their packed tensors (serving/engine/quantized_checkpoint.py) and written by
round-to-nearest (benchmarks/gptq_rtn.py).

The reader is checked against gptqmodel itself on real bundles: for every quantized layer of a real GPTQ and a
real AWQ checkpoint (gptqmodel 7.6 quantizing a tiny Llama through quantize/), our codes, scales and zero points
dequantize bit for bit to gptqmodel's own ``dequantize_weight`` / ``awq_weight_dequantize``, and the model our
loader builds with gptqmodel blocked gives the logits of the library path. The RTN writer's checkpoint reads
back exactly and gptqmodel reads it as we do. What the reader does not support is refused by name.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.gptq_rtn import write_rtn_gptq_checkpoint
from quantize.rtn import rtn_quantize
from serving.engine.quantized_checkpoint import (
    QuantizedLinear,
    is_quantized_dir,
    load_model,
    materialize_dense,
    read_quantized_linears,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def rtn_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return write_rtn_gptq_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("rtn") / "gptq", group_size=32,
                                     device="cpu")


def library_weights(model_dir: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The checkpoint loaded by transformers + gptqmodel in fp32, and each quantized layer's weight [out, in] as
    gptqmodel dequantizes it (``serving.engine.dequantize`` calls the library's own dequantizer)."""
    from transformers import AutoModelForCausalLM

    from serving.engine.dequantize import dequantize_linears

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    replaced = dequantize_linears(model)
    names = {module: name for name, module in model.named_modules()}
    return model, {names[linear]: linear.weight.detach() for linear in replaced}


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 41).remainder(model.config.vocab_size).view(1, -1)
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_codes_dequantize_to_gptqmodels_weights_bit_for_bit(real_quantized_dirs, method):
    ours = read_quantized_linears(real_quantized_dirs[method])
    _, theirs = library_weights(real_quantized_dirs[method])
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * len(PROJECTIONS)
    for name, q in ours.items():
        assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15 and int(q.zeros.max()) <= 15
        # gptqmodel computes in the scales' dtype (fp16) and we in the same: the same rounding, bit for bit
        assert torch.equal(q.dequantize().float(), theirs[name]), name
    if method == "gptq":  # symmetric: every zero point is the grid's middle
        assert all(bool((q.zeros == 8).all()) for q in ours.values())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_the_model_loads_without_gptqmodel_and_answers_as_the_library_path(real_quantized_dirs, method,
                                                                           monkeypatch):
    library_model, _ = library_weights(real_quantized_dirs[method])
    expected = logits(library_model)
    for blocked in ("gptqmodel", "optimum"):  # any import of them now fails
        monkeypatch.setitem(sys.modules, blocked, None)
    model, codes = load_model(real_quantized_dirs[method], torch.float32, "cpu")
    assert getattr(model.config, "quantization_config", None) is None
    assert len(codes) == 2 * len(PROJECTIONS)
    for module, q in codes.items():  # placeholders: the right out size, no storage; the codes hold the weight
        assert isinstance(module, torch.nn.Linear) and tuple(module.weight.shape) == (q.out_features, 0)
    dense = {name: p for name, p in library_model.named_parameters() if not name.endswith("_proj.weight")}
    for name, p in model.named_parameters():
        if not name.endswith("_proj.weight"):
            assert torch.equal(p, dense[name]), name  # embeddings, norms, head: the checkpoint's own
    assert_same_logits(model, codes, expected)


def assert_same_logits(model: torch.nn.Module, codes: dict, expected: torch.Tensor) -> None:
    """With each placeholder given our dequantized weight, rounded to fp16 as gptqmodel rounds it, the model
    ``load_model`` built computes the library path's logits."""
    for module, q in codes.items():
        module.weight = torch.nn.Parameter(q.dequantize().float(), requires_grad=False)
    assert torch.allclose(logits(model), expected, rtol=0, atol=1e-5)


def test_rtn_checkpoint_reads_back_exactly(tiny_model_dir, rtn_dir):
    assert is_quantized_dir(rtn_dir) and not is_quantized_dir(tiny_model_dir)
    config = json.loads((rtn_dir / "config.json").read_text())["quantization_config"]
    assert {k: config[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format")} \
        == {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
            "checkpoint_format": "gptq"}
    source = load_file(str(tiny_model_dir / "model.safetensors"))
    written = load_file(str(rtn_dir / "model.safetensors"))
    read = read_quantized_linears(rtn_dir)
    assert len(read) == sum(name.endswith("_proj.weight") for name in source)
    for name, tensor in source.items():
        prefix = name.removesuffix(".weight")
        if prefix not in read:
            assert torch.equal(written[name], tensor), name  # embeddings, norms, head: verbatim
            continue
        codes, scale, zero = rtn_quantize(tensor, 4, 32, sym=True)
        q = read[prefix]
        assert torch.equal(q.codes, codes.to(torch.uint8)), name
        assert torch.equal(q.scales, scale.half()) and bool((q.zeros == 8).all()), name
        assert written[f"{prefix}.qzeros"].unique().tolist() == [0x77777777]  # v1: zero point 8 stored as 7


@pytest.mark.slow
def test_gptqmodel_reads_the_rtn_checkpoint_as_we_do(rtn_dir):
    library_model, theirs = library_weights(rtn_dir)
    ours = read_quantized_linears(rtn_dir)
    assert sorted(ours) == sorted(theirs)
    for name, q in ours.items():
        assert torch.equal(q.dequantize().float(), theirs[name]), name
    model, codes = load_model(rtn_dir, torch.float32, "cpu")
    assert_same_logits(model, codes, logits(library_model))


def test_materialized_weights_are_exact_then_rounded_once(rtn_dir):
    """For the HF forward: each placeholder gets (q - z) * s computed exactly, rounded once to the model dtype."""
    model, codes = load_model(rtn_dir, torch.bfloat16, "cpu")
    materialize_dense(codes, torch.bfloat16)
    for module, q in codes.items():
        assert module.weight.dtype == torch.bfloat16
        assert torch.equal(module.weight, q.dequantize(torch.float32).to(torch.bfloat16))
    assert logits(model).isfinite().all()


def test_fused_layers_are_their_parts_side_by_side(rtn_dir):
    read = read_quantized_linears(rtn_dir)
    parts = [read[f"model.layers.1.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")]
    fused = QuantizedLinear.cat(parts)
    assert fused.out_features == sum(p.out_features for p in parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="share in_features"):
        QuantizedLinear.cat([parts[0], read["model.layers.1.mlp.down_proj"]])


def _variant(rtn_dir: Path, out: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the RTN checkpoint with quantization_config keys and tensors replaced."""
    shutil.copytree(rtn_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"].update(config or {})
    (out / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(out / "model.safetensors"))
    state.update(tensors or {})
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("config,message", [
    ({"bits": 8}, "config.json: bits=8"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"lm_head": True}, "lm_head=true"),
    ({"pack_dtype": "int16"}, "pack_dtype"),
    ({"quant_method": "awq", "checkpoint_format": "gemm", "zero_point": False}, "AWQ without zero points"),
])
def test_refuses_configs_it_cannot_read(rtn_dir, tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        read_quantized_linears(_variant(rtn_dir, tmp_path / "variant", config=config))


def test_gptq_v2_stores_zero_points_as_they_are(rtn_dir, tmp_path):
    """The same layers written in the v2 layout (zero points not minus one) read back to the same grid."""
    state = load_file(str(rtn_dir / "model.safetensors"))
    v2 = _variant(rtn_dir, tmp_path / "v2", config={"checkpoint_format": "gptq_v2"},
                  tensors={n: torch.full_like(t, 0x88888888 - (1 << 32))  # every nibble 8, as an int32
                           for n, t in state.items() if n.endswith("qzeros")})
    v1_read, v2_read = read_quantized_linears(rtn_dir), read_quantized_linears(v2)
    for name, q in v1_read.items():
        assert torch.equal(v2_read[name].zeros, q.zeros) and torch.equal(v2_read[name].dequantize(), q.dequantize())


def test_refuses_tensors_it_cannot_read(rtn_dir, tmp_path):
    name = "model.layers.0.mlp.down_proj"
    k = read_quantized_linears(rtn_dir)[name].in_features
    act_order = torch.randperm(k, generator=torch.Generator().manual_seed(0)).to(torch.int32) // 32
    bad = _variant(rtn_dir, tmp_path / "act-order", config={"desc_act": True}, tensors={f"{name}.g_idx": act_order})
    with pytest.raises(ValueError, match=f"model.safetensors: {name}.g_idx: groups are not k // 32"):
        read_quantized_linears(bad)
    qzeros = load_file(str(rtn_dir / "model.safetensors"))[f"{name}.qzeros"]
    bad = _variant(rtn_dir, tmp_path / "zero16", tensors={f"{name}.qzeros": torch.full_like(qzeros, -1)})
    with pytest.raises(ValueError, match=f"{name}.qzeros: a v1 zero point of 16"):
        read_quantized_linears(bad)
    scales = load_file(str(rtn_dir / "model.safetensors"))[f"{name}.scales"]
    bad = _variant(rtn_dir, tmp_path / "scales", tensors={f"{name}.scales": scales[:1]})
    with pytest.raises(ValueError, match=f"{name}.scales: shape"):
        read_quantized_linears(bad)
