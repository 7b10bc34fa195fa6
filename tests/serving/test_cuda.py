"""The engine on a real CUDA device, no mocks: `pytest -m cuda tests/serving/test_cuda.py` on a GPU machine.

Skipped wherever torch sees no CUDA device (the hook in tests/conftest.py). They import only what the GPU
machine has (torch, transformers; no fastapi), so they drive the engine and its core process directly:
- greedy output token-identical to Hugging Face `generate` on the same GPU in fp32, and in bf16 identical up
  to bf16 rounding at near-ties, both forwards;
- the KV cache sized from the device's memory (`gpu_memory_utilization`), and `max_model_len` derived from
  it, with the one-line refusal of a context the cache cannot hold;
- `--dtype auto` on this device;
- a real device-side assert (an out-of-range token id reaching the embedding kernel) ending the engine-core
  process with its device-error status instead of failing one request.
"""

from __future__ import annotations

import dataclasses
import gc
import random

import pytest
import torch

from artifacts.common.device import BF16_CAPABILITY
from serving.engine import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from serving.engine.core_process import CoreFailed
from serving.engine.device_errors import DEVICE_ERROR_EXIT
from serving.engine.device_facts import probe
from serving.engine.device_memory import kv_block_bytes
from tests.serving import device_fault
from tests.serving.conftest import build_tiny_model

pytestmark = pytest.mark.cuda

GIB = 2 ** 30
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(autouse=True)
def _free_the_device():
    """Each test sizes its cache from what is free: the previous test's engine must be gone."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(7, 400) for _ in range(37)]
    ps = [[rng.randrange(7, 400) for _ in range(rng.randint(2, 60))] for _ in range(6)]
    return ps + [shared + [rng.randrange(7, 400) for _ in range(rng.randint(1, 9))] for _ in range(3)]


@pytest.mark.parametrize("model_impl", ["compact", "hf"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_output_is_hugging_face_generate_on_the_gpu(tiny_model_dir, prompts, dtype, model_impl):
    """fp32: token for token what HF `generate` gives. bf16: our kernels round differently from HF's, and at
    a near-tie (two logits one bf16 step apart: it happened on CPU at the 14th token of one prompt) the
    continuations part; so each of our tokens is checked against HF's logits for our own sequence (teacher
    forcing): it must be HF's argmax, or within bf16 rounding of it (2 % of the row's largest logit)."""
    from transformers import AutoModelForCausalLM

    config = EngineConfig(device="cuda", dtype=dtype, model_impl=model_impl, gpu_memory_utilization=0.3)
    engine = LLMEngine.from_pretrained(tiny_model_dir, config)
    assert engine.runner.device.type == "cuda" and engine.runner.dtype == getattr(torch, dtype)
    ours = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    del engine
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=getattr(torch, dtype)).to("cuda").eval()
    with torch.no_grad():
        for p, got in zip(prompts, ours):
            if dtype == "float32":
                ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
                assert got == ref[0, len(p):].tolist(), p
                continue
            logits = hf(torch.tensor([p + got], device="cuda")).logits[0, len(p) - 1:-1].float()
            best = logits.max(-1).values
            mine = logits.gather(1, torch.tensor(got, device="cuda")[:, None])[:, 0]
            assert bool(((best - mine) <= 0.02 * logits.abs().max(-1).values).all()), (p, got)


def test_the_kv_cache_takes_the_share_of_the_device_the_weights_leave(tiny_model_dir):
    util = 0.5
    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda", gpu_memory_utilization=util))
    r = engine.runner
    _, total = torch.cuda.mem_get_info(r.device)
    block = kv_block_bytes(r.num_layers, r.block_size, r.kv_heads, r.head_dim, r.k_caches[0].element_size())
    cache = r.num_blocks * block
    assert r.cache_flag == "--gpu-memory-utilization"
    assert sum(t.numel() * t.element_size() for t in r.k_caches + r.v_caches) == cache
    # the tiny model's weights and activations are megabytes: nearly all of the share is cache
    assert util * total - 2 * GIB < cache <= util * total
    assert engine.max_model_len == r.max_position  # 512: far less than the cache holds


def test_max_model_len_follows_a_cache_smaller_than_the_models_context(tmp_path):
    """A model with 8M positions and a 5 % share: the context is what the cache holds for one sequence, and
    asking for the model's whole context is one line naming the flags."""
    positions = 2 ** 23
    model = build_tiny_model(tmp_path / "long", hidden=256, heads=4, kv_heads=4, max_pos=positions)
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.05, model_impl="hf")
    engine = LLMEngine.from_pretrained(model, config)
    capacity = engine.runner.num_blocks * config.block_size
    assert 100_000 < capacity < positions and engine.max_model_len == capacity
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    with pytest.raises(ModelLoadError) as err:
        LLMEngine.from_pretrained(model, dataclasses.replace(config, max_model_len=positions))
    assert str(err.value).startswith(f"--max-model-len {positions}: needs {positions // 16} blocks of 16 tokens, "
                                     "the cache has ")
    assert str(err.value).endswith("; lower --max-model-len or raise --gpu-memory-utilization")


def test_dtype_auto_is_what_this_device_computes_natively(tiny_model_dir):
    facts = probe(torch.device("cuda"))
    capability = torch.cuda.get_device_capability()
    assert facts.capability == capability and facts.bf16_native == (capability >= BF16_CAPABILITY)
    expected = torch.bfloat16 if facts.bf16_native else torch.float16
    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=64))  # device auto: the GPU
    r = engine.runner
    assert r.device.type == "cuda" and r.dtype == expected and r.k_caches[0].dtype == expected
    assert next(r.model.parameters()).dtype == expected


def test_a_real_device_side_assert_ends_the_engine_core_with_its_status(tiny_model_dir):
    """An out-of-range token id reaches the embedding kernel (injected past the API's validation, the kernel's
    assert is real): the core reports a device error and exits with DEVICE_ERROR_EXIT, not isolating it."""
    messages, exitcode = device_fault.run_core_until_it_ends(tiny_model_dir, "index",
                                                            EngineConfig(device="cuda", num_blocks=64))
    failed = messages[-1]
    assert isinstance(failed, CoreFailed) and failed.device_error, messages[-1]
    assert "device-side assert" in failed.error or "CUDA error" in failed.error, failed.error
    assert exitcode == DEVICE_ERROR_EXIT
