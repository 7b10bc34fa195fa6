"""The C++ CPU kernels: equal to the torch ops they replace, and the engine stays exact with and without them."""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest
import torch

from serving.engine import EngineConfig, LLMEngine, SamplingParams, cpp_build, cpu_kernels
from serving.engine.attention import AttentionMetadata, DecodeGroup, bucket_by_length, paged_attention
from tests.serving.attention_support import decode_case

kernels = cpu_kernels.load()
kernel = kernels.paged_decode if kernels is not None else None
needs_kernel = pytest.mark.skipif(kernels is None, reason="CPU kernels did not build (no C++ compiler?)")


def _torch_meta(kc, vc, tables, lens, slots, bs):
    meta = AttentionMetadata([kc], [vc], slots, num_decode=len(lens), block_size=bs)
    for rows in bucket_by_length(lens, bs):
        nblk = -(-max(lens[r] for r in rows) // bs)
        tab = [tables[r][:nblk] + [0] * (nblk - len(tables[r][:nblk])) for r in rows]
        mask = torch.arange(nblk * bs)[None, :] < torch.tensor([lens[r] for r in rows])[:, None]
        meta.decode_groups.append(DecodeGroup(torch.tensor(rows), torch.tensor(tab).flatten(),
                                              mask.view(len(rows), 1, 1, -1)))
    return meta


def _kernel_meta(kc, vc, tables, lens, slots, bs):
    nblk = max(len(t) for t in tables)
    return AttentionMetadata([kc], [vc], slots, num_decode=len(lens), block_size=bs,
                             decode_block_tables=torch.tensor([t + [0] * (nblk - len(t)) for t in tables]),
                             decode_lens=torch.tensor(lens), decode_kernel=kernel)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 2, 16), (16, 2, 64), (4, 1, 128), (6, 2, 24)])
def test_kernel_matches_torch_decode_path(heads, kv_heads, d):
    """(8, 2, 64), (16, 2, 64), (4, 1, 128): the vectorized shapes; (4, 2, 16) and (6, 2, 24): the generic loop."""
    rng = random.Random(heads * d)
    lens = [1, 2, 15, 16, 17] + [rng.randint(1, 300) for _ in range(11)]
    bs = 16
    kc, vc, tables, q, k_new, v_new, slots = decode_case(heads, kv_heads, d, lens, bs)
    ref = paged_attention(q, k_new, v_new, 0, _torch_meta(kc.clone(), vc.clone(), tables, lens, slots, bs), None)
    out = paged_attention(q, k_new, v_new, 0, _kernel_meta(kc, vc, tables, lens, slots, bs), None)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_kernel_ignores_masked_extremes():
    """Huge scores on one token must not overflow, tiny ones underflow to weight 0 exactly like softmax."""
    bs, lens = 4, [9, 3]
    kc, vc, tables, q, k_new, v_new, slots = decode_case(4, 2, 64, lens, bs)
    kc.mul_(30)
    ref = paged_attention(q, k_new, v_new, 0, _torch_meta(kc.clone(), vc.clone(), tables, lens, slots, bs), None)
    out = paged_attention(q, k_new, v_new, 0, _kernel_meta(kc, vc, tables, lens, slots, bs), None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows,n", [(1, 512), (37, 64), (5, 24), (3, 100)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(rows, n, with_delta):
    torch.manual_seed(rows)
    h, delta, w = torch.randn(rows, n), torch.randn(rows, n), torch.randn(n)
    ref_h = h + delta if with_delta else h.clone()
    ref = torch.nn.functional.rms_norm(ref_h, (n,), w, 1e-5)
    out = torch.empty_like(h)
    kernels.add_rms_norm(h, delta if with_delta else None, w, 1e-5, out)
    torch.testing.assert_close(h, ref_h, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows,nq,nk,d", [(1, 8, 2, 64), (33, 4, 2, 16), (5, 6, 6, 24)])
def test_rope_matches_compact_torch_rope(rows, nq, nk, d):
    from serving.engine.compact_llama import CompactLlama

    torch.manual_seed(rows)
    qkv = torch.randn(rows, (nq + 2 * nk) * d)
    freqs = torch.outer(torch.arange(300.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :].contiguous(), emb.sin()[:, None, :].contiguous()
    pos = torch.randint(0, 300, (rows,))
    q, k = torch.empty(rows, nq, d), torch.empty(rows, nk, d)
    kernels.rope(qkv, pos, cos, sin, nq, nk, q, k)
    ref_q = CompactLlama._rope(qkv[:, :nq * d].view(rows, nq, d), cos[pos], sin[pos])
    ref_k = CompactLlama._rope(qkv[:, nq * d:(nq + nk) * d].view(rows, nk, d), cos[pos], sin[pos])
    torch.testing.assert_close(q, ref_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, ref_k, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def gqa4_model_dir(tmp_path_factory):
    """Four query heads per KV head, head_dim 16: the kernel's vectorized path inside the engine."""
    from tests.serving.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gqa4") / "model", hidden=128, heads=8, kv_heads=2)


@pytest.mark.parametrize("use_kernel,block_size,spec", [(True, 4, 0), (True, 16, 0), (True, 16, 4), (False, 16, 0)],
                         ids=["kernels-block4", "kernels-block16", "kernels-block16-speculative", "torch"])
def test_engine_greedy_matches_hf_on_both_paths(gqa4_model_dir, use_kernel, block_size, spec, monkeypatch):
    """Chunked prefill (a 32-token budget against prompts of up to 70) continues chunks from the cache; with
    block size 16 those chunks, and the speculative verify chunks, take the prefill kernel."""
    from transformers import AutoModelForCausalLM

    if use_kernel and kernel is None:
        pytest.skip("CPU kernels did not build")
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    hf = AutoModelForCausalLM.from_pretrained(gqa4_model_dir, dtype=torch.float32).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(7, 400) for _ in range(rng.randint(2, 70))] for _ in range(8)]
    prompts[0] = [11, 12, 13, 14] * 12  # repeats itself: the n-gram lookup has guesses to verify
    engine = LLMEngine.from_pretrained(gqa4_model_dir, EngineConfig(num_blocks=128, block_size=block_size,
                                                                    max_num_batched_tokens=32,
                                                                    speculative_tokens=spec))
    assert (engine.runner.decode_kernel is not None) == use_kernel
    assert (engine.runner.compact.kernels is not None) == use_kernel
    assert (engine.runner.prefill_kernel is not None) == (use_kernel and block_size == 16)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            g = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert o.token_ids == g[0, len(p):].tolist()
    if spec:
        assert engine.speculation.drafted > 0


def _prefill_reference(q, kc, vc, tables, rows, starts, scale):
    """Each chunk with SDPA over its whole context, gathered from the cache, with an offset-causal mask."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = kc.shape[2]
    out = torch.empty_like(q)
    for p, start in enumerate(starts):
        r0, r1 = rows[p], rows[p + 1]
        ctx = start + r1 - r0
        k = kc[tables[p]].reshape(-1, kv_heads, d)[:ctx].transpose(0, 1)[None]
        v = vc[tables[p]].reshape(-1, kv_heads, d)[:ctx].transpose(0, 1)[None]
        mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q[r0:r1].transpose(0, 1)[None], k, v, attn_mask=mask,
                                                             scale=scale, enable_gqa=heads != kv_heads)
        out[r0:r1] = o[0].transpose(0, 1)
    return out


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 2, 16), (8, 2, 32), (8, 8, 128), (8, 1, 64), (6, 2, 32)])
def test_prefill_kernel_matches_sdpa_over_the_gathered_context(heads, kv_heads, d):
    """Fresh chunks and chunks continuing a cached context (starts off the block grid), tiles of 16 rows with
    remainders, one to eight query heads per KV head, blocks scattered through the cache."""
    torch.manual_seed(0)
    rng = random.Random(0)
    specs = [(0, 1), (0, 37), (21, 5), (100, 70), (0, 16), (33, 1), (7, 130)]  # (cached tokens, chunk rows)
    free = list(range(1, 200))
    rng.shuffle(free)
    tables, rows = [], [0]
    for start, n in specs:
        tables.append([free.pop() for _ in range(-(-(start + n) // 16))])
        rows.append(rows[-1] + n)
    kc, vc = torch.randn(200, 16, kv_heads, d), torch.randn(200, 16, kv_heads, d)
    q = torch.randn(rows[-1], heads, d)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = torch.full_like(q, float("nan"))
    starts = [start for start, _ in specs]
    kernels.paged_prefill(q, kc, vc, padded, torch.tensor(rows), torch.tensor(starts), d ** -0.5, out)
    torch.testing.assert_close(out, _prefill_reference(q, kc, vc, tables, rows, starts, d ** -0.5),
                               atol=1e-5, rtol=1e-5)


def test_load_respects_the_switch(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_kernels", None)
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert cpu_kernels.load() is None


def test_no_compiler_means_torch_path(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_kernels", None)
    monkeypatch.setattr(cpp_build.shutil, "which", lambda name: None)
    assert cpu_kernels.load() is None


@needs_kernel
@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_kernels_are_built_with_openmp_and_share_torchs_thread_pool():
    """``at::parallel_for`` in an extension splits work over threads only when the extension is compiled with
    OpenMP; without it every kernel silently ran on one thread (decode attention at 64 streams took 1.9x as
    long on 2 threads). Built with it, the extension must bind to the libgomp torch loaded, not a second one."""
    from serving.engine import int4_linear

    for module in (kernels, int4_linear.load()):
        dynamic = subprocess.run(["readelf", "-d", module.__file__], capture_output=True, text=True, check=True)
        assert "libgomp" in dynamic.stdout, module.__file__
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes


@needs_kernel
@pytest.mark.parametrize("rows,inner", [(1, 1408), (5, 64), (3, 37)])  # 37: a tail past the vector loop (16 or 8 lanes)
def test_silu_mul_equals_torch(rows, inner):
    gu = torch.randn(rows, 2 * inner) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated both ways, and zero
    out = torch.empty(rows, inner)
    kernels.silu_mul(gu, out)
    gate, up = gu.chunk(2, dim=-1)
    assert torch.allclose(out, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_size", [16, 4], ids=["prefill-kernel", "prefill-sdpa"])
def test_every_layer_in_one_call_gives_the_python_loops_tokens_and_logprobs(gqa4_model_dir, block_size, monkeypatch):
    """``llama_layers`` runs the decoder layers in one C++ call where every projection is tiled (forced here: on
    Intel CPUs the automatic choice is MKL). The same requests, with the one call and with the layers looped in
    Python, give the same tokens and the same logprobs to the bit (the same kernels in the same order), and HF's
    greedy tokens. With block size 16 every step runs as one call (prefill chunks, prefix context, decodes); with
    block size 4 the prefill chunks take SDPA, so only decode-only steps can, and a step mixing both loops."""
    from transformers import AutoModelForCausalLM

    from serving.engine.linear_backend import GEMM_ENV, tiled_kernels

    if kernel is None or tiled_kernels() is None:
        pytest.skip("CPU kernels or the tiled GEMM not built")
    monkeypatch.setenv(GEMM_ENV, "tiled")
    rng = random.Random(2)
    prompts = [[rng.randrange(7, 400) for _ in range(rng.randint(2, 70))] for _ in range(8)]
    prompts[1] = prompts[0][:40] + [9, 10]  # shares cached blocks with the first: a chunk with prefix context
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)

    def run(one_call: bool) -> tuple[list, int, int]:
        """A fresh engine each time: a second run in one engine would find the first one's prompts cached."""
        engine = LLMEngine.from_pretrained(gqa4_model_dir, EngineConfig(num_blocks=128, block_size=block_size,
                                                                        max_num_batched_tokens=32))
        compact = engine.runner.compact
        assert {p.backend for p in compact.projections} == {"tiled"}
        compact.fused_layers = one_call
        outs = engine.generate(prompts, params)
        return outs, compact.fused_steps, engine.stats().num_steps

    fused, fused_steps, steps = run(True)
    looped, looped_steps, _ = run(False)
    assert looped_steps == 0
    if block_size == 16:
        assert fused_steps == steps
    else:
        assert 0 < fused_steps < steps
    for a, b in zip(fused, looped, strict=True):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs and a.outputs[0].logprobs
    hf = AutoModelForCausalLM.from_pretrained(gqa4_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p, o in zip(prompts, fused, strict=True):
            g = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert o.token_ids == g[0, len(p):].tolist()
