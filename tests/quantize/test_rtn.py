import json

import pytest
import torch

from quantize.config import QuantizeConfig
from quantize.rtn import fake_quantize, quantize_rtn, rtn_dequantize, rtn_quantize


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, -1), (3, 16), (8, 64)])
def test_error_is_at_most_half_a_step_per_group(sym, bits, group_size):
    torch.manual_seed(bits + group_size)
    w = torch.randn(48, 128) * torch.rand(48, 1) * 3
    q, scale, zero = rtn_quantize(w, bits, group_size, sym)
    assert q.min() >= 0 and q.max() <= 2**bits - 1 and torch.equal(q, q.round())
    deq = rtn_dequantize(q, scale, zero, group_size)
    g = 128 if group_size == -1 else group_size
    err = (deq - w).abs().reshape(48, -1, g)
    bound = scale.unsqueeze(-1) / 2
    # float32 rounding of w/scale and of scale*(q-zero) adds ~1 ulp of |w|.
    assert torch.all(err <= bound + 1e-6 * w.abs().reshape(48, -1, g) + 1e-7)
    assert torch.allclose(fake_quantize(w, bits, group_size, sym), deq)


def test_exact_on_representable_weights():
    torch.manual_seed(0)
    bits, g, maxq = 4, 32, 15
    scale = 2.0 ** -torch.randint(2, 8, (16, 4)).float()  # powers of two: exact in float
    zero = torch.randint(1, maxq, (16, 4)).float()
    q = torch.randint(0, maxq + 1, (16, 4, g)).float()
    q[..., 0], q[..., 1] = 0, maxq  # every group spans the full grid, so the fitted grid is the same
    w = ((q - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(16, 4 * g)
    assert torch.equal(fake_quantize(w, bits, g, sym=False), w)
    _, scale2, zero2 = rtn_quantize(w, bits, g, sym=False)
    assert torch.equal(scale2, scale) and torch.equal(zero2, zero)


def test_zero_group_stays_zero():
    w = torch.zeros(4, 64)
    w[:, 32:] = torch.randn(4, 32)
    out = fake_quantize(w, 4, 32, sym=True)
    assert torch.equal(out[:, :32], torch.zeros(4, 32))


def test_quantize_rtn_writes_loadable_fake_quantized_dir(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = QuantizeConfig(methods=["gptq"], group_size=32)
    out = quantize_rtn(tiny_model_dir, tmp_path / "rtn", cfg)
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert (out / "generation_config.json").is_file()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    meta = json.loads((out / "rtn_baseline.json").read_text())
    assert meta["bits"] == 4 and meta["group_size"] == 32
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rtn = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref_sd, rtn_sd = ref.state_dict(), rtn.state_dict()
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(ref_sd[name], rtn_sd[name])
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(ref_sd[name], rtn_sd[name])
    # Each group of 32 holds at most 16 distinct values.
    groups = rtn_sd[name].reshape(-1, 32)
    assert max(len(torch.unique(row)) for row in groups) <= 16
