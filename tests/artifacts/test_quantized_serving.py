"""A 4-bit snapshot is served through the engine's fast path with its quantized weights dequantized once,
and answers as the quantized model does through the Hugging Face forward (gptqmodel's kernels)."""

from __future__ import annotations

import pytest

from serving.engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS = ["The quick brown fox", "Hello world", "Once upon a time", "What is 2 + 2?",
           "def add(a, b):", "Grüße aus München", "The park was", "Numbers: 1, 2, 3,"]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantized_checkpoint_takes_the_fast_path_with_the_quantized_models_replies(real_quantized_dirs, method):
    model_dir = real_quantized_dirs[method]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    through_hf = LLMEngine.from_pretrained(model_dir, EngineConfig(model_impl="hf", num_blocks=64, block_size=8))
    assert through_hf.runner.compact is None
    fast = LLMEngine.from_pretrained(model_dir, EngineConfig(num_blocks=64, block_size=8))
    assert fast.runner.compact is not None  # the compact forward, not the HF one
    linears = [m for m in fast.runner.model.modules() if type(m).__name__ == "Linear"]
    assert len(linears) >= 7 * 2  # every projection of both layers is a plain Linear now
    expected = [o.token_ids for o in through_hf.generate(PROMPTS, params)]
    served = [o.token_ids for o in fast.generate(PROMPTS, params)]
    # gptqmodel's CPU kernels compute in bf16, the fast path in fp32 on the same 4-bit values: nearly all
    # greedy tokens agree, and every reply starts the same way
    agree = sum(a == b for e, s in zip(expected, served) for a, b in zip(e, s))
    assert agree >= 0.9 * sum(map(len, expected)), (expected, served)
    assert all(e[:4] == s[:4] for e, s in zip(expected, served))


def test_the_hf_path_stays_available_for_quantized_checkpoints(real_quantized_dirs):
    engine = LLMEngine.from_pretrained(real_quantized_dirs["gptq"], EngineConfig(model_impl="hf", num_blocks=32,
                                                                                   block_size=8))
    assert engine.runner.compact is None
    assert getattr(engine.runner.model.config, "quantization_config", None) is not None
