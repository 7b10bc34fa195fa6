"""The engine on a real CUDA device, no mocks: `pytest -m cuda tests/serving/test_cuda.py` on a GPU machine.

Skipped wherever torch sees no CUDA device (the hook in tests/conftest.py). They import only what the GPU
machine has (torch, transformers; no fastapi), so they drive the engine and its core process directly:
- greedy output token-identical to Hugging Face `generate` on the same GPU in fp32, and in bf16 identical up
  to bf16 rounding at near-ties, both forwards;
- the KV cache sized from the device's memory (`gpu_memory_utilization`), and `max_model_len` derived from
  it, with the one-line refusal of a context the cache cannot hold;
- `--dtype auto` on this device;
- a real device-side assert (an out-of-range token id reaching the embedding kernel) ending the engine-core
  process with its device-error status instead of failing one request;
- async scheduling (the default here) giving the tokens of one step at a time.
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


# ----------------------------------------------------------------------------- the GPU path (issue 34)
def _reference_attention(q, kc, vc, table, q_pos, scale):
    """q [n, H, D] at positions q_pos over the context in ``table``'s blocks, in float64."""
    heads, d, kv_heads = q.shape[1], q.shape[2], kc.shape[2]
    k = kc[table].reshape(-1, kv_heads, d).double().repeat_interleave(heads // kv_heads, dim=1)
    v = vc[table].reshape(-1, kv_heads, d).double().repeat_interleave(heads // kv_heads, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i, pos in enumerate(q_pos):
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k[:pos + 1]) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[:pos + 1])
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernels_in_half_precision_match_a_float64_reference(dtype):
    """The Triton kernels compiled for this GPU (CPU CI runs them interpreted, in fp32/fp16 only): decode at
    mixed lengths, some past one split, and prefill chunks with and without cached context, the 1B model's head
    layout (32 query heads over 8 KV heads, head_dim 64)."""
    from serving.engine import triton_attention as ta

    torch.manual_seed(0)
    heads, kv_heads, d, bs, num_blocks = 32, 8, 64, 16, 400
    kc = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    perm = torch.randperm(num_blocks).tolist()
    lens = [1, 16, 17, 300, 1000, 77]
    tables = []
    for n in lens:
        tables.append([perm.pop() for _ in range(-(-n // bs))])
    width = max(map(len, tables))
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), heads, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    ta.paged_decode(q, kc, vc, table_t, torch.tensor(lens, dtype=torch.int32, device="cuda"), scale, out)
    for i, n in enumerate(lens):
        ref = _reference_attention(q[i:i + 1], kc, vc, tables[i], [n - 1], scale)
        err = (out[i:i + 1].double() - ref).norm() / ref.norm()
        assert err < 1e-2, (n, float(err))
    # prefill: a fresh prompt, a chunk after 200 cached tokens, a one-token chunk after 900
    chunks = [(0, 120), (200, 64), (900, 1)]  # (first position, rows)
    ctx_tables = [tables[3], tables[4], tables[4]]
    rows = sum(n for _, n in chunks)
    qp = torch.randn(rows, heads, d, device="cuda", dtype=dtype)
    outp = torch.full_like(qp, float("nan"))
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    pw = max(map(len, ctx_tables))
    ta.paged_prefill(qp, kc, vc,
                     torch.tensor([t + [0] * (pw - len(t)) for t in ctx_tables], dtype=torch.int32, device="cuda"),
                     torch.tensor(starts, dtype=torch.int32, device="cuda"),
                     torch.tensor([f for f, _ in chunks], dtype=torch.int32, device="cuda"), scale, outp)
    for (first, n), table, lo in zip(chunks, ctx_tables, starts):
        ref = _reference_attention(qp[lo:lo + n], kc, vc, table, list(range(first, first + n)), scale)
        err = (outp[lo:lo + n].double() - ref).norm() / ref.norm()
        assert err < 1e-2, (first, n, float(err))


def test_graphs_eager_and_torch_attention_give_the_same_tokens_in_fp32(tiny_model_dir, prompts):
    """The default GPU path (Triton kernels, decode steps replayed from CUDA graphs), the same kernels run eagerly,
    and the torch attention path: token for token the same greedy output in fp32."""
    outputs = {}
    for name, overrides in (("graphs", {}), ("eager", {"enforce_eager": True}),
                            ("torch", {"attention_backend": "torch", "enforce_eager": True})):
        engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda", dtype="float32",
                                                                        num_blocks=512, **overrides))
        r = engine.runner
        assert r.attention_backend == ("torch" if name == "torch" else "triton")
        assert (r.graphs is not None) == (name == "graphs")
        outputs[name] = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        del engine, r
        gc.collect()
    assert outputs["graphs"] == outputs["eager"] == outputs["torch"]


def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time(tiny_model_dir, prompts):
    """One step in flight, the GPU's default: each decode row reads the previous step's sampled id on the device
    (into the graph's static ids before a replay). Greedy and seeded sampling in fp32, token for token what the
    engine gives one step at a time, and every step but each batch's last waited for after the next was launched."""
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = {}
    for mode in (None, False):
        engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda", dtype="float32",
                                                                        num_blocks=512, async_scheduling=mode))
        assert engine.async_scheduling is (mode is None) and engine.runner.graphs is not None
        outputs[mode] = [o.token_ids for o in engine.generate(prompts, GREEDY)] + \
            [o.token_ids for o in engine.generate(prompts, seeded)]
        assert engine.num_steps_overlapped == (engine.num_steps - 2 if mode is None else 0)
        del engine
        gc.collect()
    assert outputs[None] == outputs[False]


def test_the_triton_gemv_gives_the_tokens_cublas_gives_in_fp32(tiny_model_dir, prompts, monkeypatch):
    """``LLM_LIFECYCLE_GPU_GEMV=triton`` (serving/engine/triton_gemv.py) at batch 1, graphs on: the same greedy
    tokens as cuBLAS's projections in fp32, every projection of the model on the Triton GEMV."""
    from serving.engine.compact_llama import DenseLinear

    outputs = {}
    for gemv in ("cublas", "triton"):
        monkeypatch.setenv("LLM_LIFECYCLE_GPU_GEMV", gemv)
        engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda", dtype="float32",
                                                                        num_blocks=512, max_num_seqs=1))
        compact = engine.runner.compact
        dense = [p for p in (*compact.projections, compact.lm_head) if isinstance(p, DenseLinear)]
        assert dense and all(d.backend == ("triton-gemv" if gemv == "triton" else "plain") for d in dense)
        outputs[gemv] = [o.token_ids for o in engine.generate(prompts[:2], GREEDY)]
        del engine
        gc.collect()
    assert outputs["triton"] == outputs["cublas"]


def test_a_decode_step_waits_for_the_gpu_once_at_most(tiny_model_dir):
    """torch's sync debug mode flags every operation that makes the host wait for the GPU: over decode-only steps
    of a mixed greedy and sampled batch, at most the one wait per step for the sampled ids (the engine waits on an
    event, which torch may or may not report) and nothing else."""
    import warnings

    engine = LLMEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda", num_blocks=512))
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(12):
        engine.add_request(f"r{i}", [7 + i, 40, 41, 42 + i], sampled if i % 2 else greedy)
    while engine.scheduler.waiting or engine._inbox or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    steps = 5
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) in (0, steps), syncs


def test_a_gptq_checkpoint_is_served_from_its_codes_by_the_triton_kernel(tiny_model_dir, prompts, tmp_path):
    """No gptqmodel on this machine: the checkpoint is read by our reader, the compact forward serves every
    projection from its 4-bit codes, and in fp32 its greedy tokens are those of the HF forward over the same
    weights dequantized."""
    from benchmarks.gptq_rtn import write_rtn_gptq_checkpoint
    from serving.engine.triton_int4 import TritonInt4Linear

    gptq = write_rtn_gptq_checkpoint(tiny_model_dir, tmp_path / "gptq", group_size=32)
    config = EngineConfig(device="cuda", dtype="float32", num_blocks=512)
    ours = LLMEngine.from_pretrained(gptq, config)
    assert all(isinstance(p, TritonInt4Linear) for p in ours.runner.compact.projections)
    got = [o.token_ids for o in ours.generate(prompts, GREEDY)]
    del ours
    gc.collect()
    dense = LLMEngine.from_pretrained(gptq, dataclasses.replace(config, model_impl="hf"))
    assert got == [o.token_ids for o in dense.generate(prompts, GREEDY)]
