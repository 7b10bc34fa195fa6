"""KV-cache sizing and the context length from planted memory facts (no GPU), and the profile forward on CPU.

The numbers are what a GPU would report: a 7B-shaped model in bf16 on an 80 GB device must get a cache of
about a hundred thousand tokens, where the old fixed 256 MiB budget gave it 512.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from serving.engine import EngineConfig, LLMEngine, SamplingParams
from serving.engine.config import CPU_KV_MEMORY_BYTES
from serving.engine.device_memory import (
    MemoryFacts,
    blocks_in_budget,
    derive_max_model_len,
    kv_block_bytes,
    kv_cache_bytes,
    profile_forward,
)
from serving.engine.errors import ModelLoadError

GB, GIB = 10 ** 9, 2 ** 30
# Llama-2-7B: 32 layers, 32 KV heads of 128, 4096 positions; Llama-3-8B: GQA with 8 KV heads, 8192 positions
LLAMA2_7B_BLOCK = kv_block_bytes(num_layers=32, block_size=16, kv_heads=32, head_dim=128, dtype_bytes=2)
LLAMA3_8B_BLOCK = kv_block_bytes(num_layers=32, block_size=16, kv_heads=8, head_dim=128, dtype_bytes=2)


def facts(weights: int, *, total: int = 80 * GB, activation: int = int(1.2 * GIB), non_torch: int = int(0.4 * GIB),
          free: int | None = None) -> MemoryFacts:
    """An otherwise idle device after the load: free is what the weights and the context left."""
    free = total - weights - int(0.5 * GIB) if free is None else free
    return MemoryFacts(total, weights, activation, non_torch, free)


def test_block_bytes_count_keys_and_values_of_every_layer():
    assert LLAMA2_7B_BLOCK == 32 * 2 * 16 * 32 * 128 * 2 == 8 * 2 ** 20  # 512 KiB per token
    assert LLAMA3_8B_BLOCK == 2 * 2 ** 20


def test_a_7b_model_on_an_80gb_device_gets_a_hundred_thousand_tokens():
    budget = kv_cache_bytes(facts(int(13.5 * GB)), 0.9)
    assert budget == int(0.9 * 80 * GB) - int(13.5 * GB) - int(1.2 * GIB) - int(0.4 * GIB)
    blocks = blocks_in_budget(budget, LLAMA2_7B_BLOCK, "--gpu-memory-utilization")
    assert blocks * 16 > 100_000
    assert derive_max_model_len(4096, None, blocks, 16, "--gpu-memory-utilization") == 4096  # the model's
    # what the fixed budget gave the same model on the same device: a few hundred tokens
    assert blocks_in_budget(CPU_KV_MEMORY_BYTES, LLAMA2_7B_BLOCK, "--kv-memory") * 16 == 512

    gqa = blocks_in_budget(kv_cache_bytes(facts(16 * GB), 0.9), LLAMA3_8B_BLOCK, "--gpu-memory-utilization")
    assert gqa * 16 > 400_000  # 8 KV heads: four times the tokens per byte
    assert derive_max_model_len(8192, None, gqa, 16, "--gpu-memory-utilization") == 8192


def test_utilization_scales_the_cache_and_a_lower_share_leaves_more_free():
    f = facts(int(13.5 * GB))
    assert kv_cache_bytes(f, 0.5) == kv_cache_bytes(f, 0.9) - int(0.9 * f.total) + int(0.5 * f.total)


def test_a_share_the_weights_fill_is_one_line_that_names_the_flags():
    with pytest.raises(ModelLoadError) as err:
        kv_cache_bytes(facts(int(13.5 * GB)), 0.1)
    message = str(err.value)
    assert "\n" not in message and message.startswith("--gpu-memory-utilization 0.1: ")
    assert "weights (12.57 GiB)" in message and "raise --gpu-memory-utilization" in message


def test_memory_other_processes_hold_is_refused_with_the_share_that_would_fit():
    f = facts(int(13.5 * GB), free=20 * GB)
    with pytest.raises(ModelLoadError) as err:
        kv_cache_bytes(f, 0.9)
    held = f.weights + f.activation_peak + f.non_torch
    most = int((f.free + held) / f.total * 100) / 100
    assert f"lower --gpu-memory-utilization to {most:.2f} or less" in str(err.value)
    assert kv_cache_bytes(f, most) <= f.free  # and that share does fit


def test_max_model_len_follows_the_model_and_the_cache():
    assert derive_max_model_len(4096, None, 100, 16, "--kv-memory") == 1600  # the cache holds less than the model
    assert derive_max_model_len(4096, 1000, 100, 16, "--kv-memory") == 1000  # the user's, when it fits
    assert derive_max_model_len(4096, 1600, 100, 16, "--kv-memory") == 1600  # exactly the cache
    with pytest.raises(ModelLoadError) as err:
        derive_max_model_len(32768, 32768, 1000, 16, "--gpu-memory-utilization")
    assert str(err.value) == ("--max-model-len 32768: needs 2048 blocks of 16 tokens, the cache has 1000; lower "
                              "--max-model-len or raise --gpu-memory-utilization")
    with pytest.raises(ModelLoadError, match=r"^--max-model-len 8192: the model's context is 4096 tokens"):
        derive_max_model_len(4096, 8192, 10_000, 16, "--kv-memory")


def test_a_budget_below_one_block_names_its_flag():
    with pytest.raises(ModelLoadError, match=r"^--kv-memory: 1000 bytes hold no KV block \(one block needs 8192\)"):
        blocks_in_budget(1000, 8192, "--kv-memory")


# ----------------------------------------------------------------------------- on the CPU, the real engine
def test_cpu_keeps_the_fixed_budget_whatever_the_gpu_share(tiny_model_dir):
    """The tiny model's block is 8 KiB: 256 MiB is 32768 blocks on CPU, with or without a GPU share; a fixed
    --kv-memory and --num-blocks size it as before, and the context is the model's up to what the cache holds."""
    for config, blocks, flag in ((EngineConfig(), 32768, "--kv-memory"),
                                 (EngineConfig(gpu_memory_utilization=0.1), 32768, "--kv-memory"),
                                 (EngineConfig(kv_memory_bytes=2 ** 20), 128, "--kv-memory"),
                                 (EngineConfig(num_blocks=8), 8, "--num-blocks")):
        engine = LLMEngine.from_pretrained(tiny_model_dir, replace(config, device="cpu"))
        assert engine.runner.device.type == "cpu" and engine.runner.dtype == torch.float32
        assert (engine.runner.num_blocks, engine.runner.cache_flag) == (blocks, flag)
        assert engine.max_model_len == min(512, blocks * 16)
    with pytest.raises(ModelLoadError, match="needs 32 blocks of 16 tokens, the cache has 8; lower --max-model-len "
                                             "or raise --num-blocks"):
        LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cpu", num_blocks=8, max_model_len=512))


def test_the_profile_forward_runs_the_largest_step_and_leaves_the_cache_alone(tiny_model_dir):
    """The forward the GPU sizing measures, run on CPU: the real runner at max_num_batched_tokens over
    max_num_seqs sequences, on a scratch cache; the engine's own cache and its answers are unchanged."""
    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cpu", num_blocks=64))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = engine.generate([[5, 6, 7, 8]], greedy)[0]
    runner = engine.runner
    caches = [k.clone() for k in runner.k_caches]
    ids = [id(k) for k in runner.k_caches]
    scratch = profile_forward(runner, num_tokens=100, num_seqs=8)
    # 7 one-token prompts of a block each and one of 93 tokens (6 blocks): 13 blocks of keys and values
    assert scratch == 13 * kv_block_bytes(runner.num_layers, 16, runner.kv_heads, runner.head_dim, 4)
    assert [id(k) for k in runner.k_caches] == ids
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.k_caches))
    after = engine.generate([[5, 6, 7, 8]], greedy)[0]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
