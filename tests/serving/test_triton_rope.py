"""The fused rotary-embedding + KV-store Triton kernel against the compact forward's torch code (``_rope`` and the
cache store by ``index_copy_``); ``test_triton_sm90`` compiles the launch for sm_90 without a GPU.

On CPU the kernel runs under triton's interpreter on small shapes; where torch sees a GPU the same tests run the
compiled kernel on it. Outputs and caches are poisoned with NaN first, so an element the kernel forgot to write,
or wrote where it should not, fails. The interpreter must be on before triton is first imported (``@triton.jit``
decides at decoration); when an earlier module of the session imported triton without it,
``test_the_module_in_a_fresh_interpreter`` runs this module again in a new process."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from serving.engine import triton_rope as tr  # noqa: E402
from serving.engine.compact_llama import CompactLlama  # noqa: E402

RUNNABLE = (DEVICE == "cuda" or isinstance(triton.language.max, InterpretedFunction))
if RUNNABLE and DEVICE == "cpu" and not tr.interpreted():  # the kernel module was imported before the switch
    tr = importlib.reload(tr)
runnable = pytest.mark.skipif(not RUNNABLE, reason="triton was imported before TRITON_INTERPRET=1 was set: "
                              "test_the_module_in_a_fresh_interpreter runs these")
REPO = Path(__file__).resolve().parents[2]
BS = 4  # cache block size
MAX_POS = 64


def _tables(head_dim: int, dtype: torch.dtype, general: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact forward's rotary tables ``[MAX_POS, 1, D]``, built as ``CompactLlama.__init__`` builds them (its
    two halves equal); ``general``: random tables whose halves differ, scaled as by an ``attention_scaling``."""
    if general:
        gen = torch.Generator().manual_seed(1)
        cos, sin = (1.25 * torch.rand(MAX_POS, 1, head_dim, generator=gen) for _ in range(2))
        return cos.to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    emb = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq).repeat(1, 2)
    return emb.cos().to(dtype)[:, None, :].to(DEVICE), emb.sin().to(dtype)[:, None, :].to(DEVICE)


def _reference(qkv, positions, cos, sin, heads, kv_heads, d, k_cache, v_cache, slots):
    """The torch path: ``CompactLlama._rope`` of q and k, then the store of the rows that have a slot."""
    t = qkv.shape[0]
    c, s = cos[positions.long()], sin[positions.long()]
    q = CompactLlama._rope(qkv[:, :heads * d].view(t, heads, d), c, s)
    k = CompactLlama._rope(qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d), c, s)
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    keep = slots >= 0
    k_cache.view(-1, kv_heads, d).index_copy_(0, slots[keep].long(), k[keep])
    v_cache.view(-1, kv_heads, d).index_copy_(0, slots[keep].long(), v[keep])
    return q


def _case(heads: int, kv_heads: int, d: int, dtype: torch.dtype, index_dtype: torch.dtype, seed: int):
    """Seven tokens at random positions into random distinct slots (never slot 0, where a wrongly clamped padding
    row would land), one of them a padding row (slot -1); qkv rows strided, as a slice of a wider buffer."""
    gen = torch.Generator().manual_seed(seed)
    t, width = 7, (heads + 2 * kv_heads) * d
    qkv = torch.randn(t, width + 8, generator=gen).to(dtype)[:, :width]
    positions = torch.randint(0, MAX_POS, (t,), generator=gen, dtype=index_dtype)
    slots = (torch.randperm(6 * BS - 1, generator=gen)[:t] + 1).to(index_dtype)
    slots[3] = -1
    return qkv.to(DEVICE), positions.to(DEVICE), slots.to(DEVICE)


def _run(heads, kv_heads, d, dtype, index_dtype=torch.int32, seed=0, general_tables=False):
    """The kernel and the reference on the same inputs: (q_out, reference q, caches, reference caches)."""
    qkv, positions, slots = _case(heads, kv_heads, d, dtype, index_dtype, seed)
    cos, sin = _tables(d, dtype, general_tables)
    kc = torch.full((6, BS, kv_heads, d), float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    ref_kc, ref_vc = kc.clone(), vc.clone()
    q_out = torch.full((qkv.shape[0], heads, d), float("nan"), dtype=dtype, device=DEVICE)
    tr.rope_and_store(qkv, positions, cos, sin, heads, kv_heads, d, kc, vc, slots, q_out)
    ref_q = _reference(qkv, positions, cos, sin, heads, kv_heads, d, ref_kc, ref_vc, slots)
    return q_out, ref_q, (kc, vc), (ref_kc, ref_vc)


def _same(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal where the reference has a value, NaN (never written) where it has none."""
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), atol=0, rtol=0)


@runnable
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (8, 8, 64), (3, 1, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_torch_path(heads, kv_heads, d, dtype):
    """GQA and plain heads, a head_dim whose half is not a power of two, random positions: q_out (the padding
    row's too) and exactly the slots of the real rows. fp16 bit for bit (the kernel rounds as torch does after
    each op); fp32 to the last bits (a GPU may fuse a product into an FMA)."""
    q_out, ref_q, caches, ref_caches = _run(heads, kv_heads, d, dtype, seed=heads * d)
    assert not q_out.isnan().any()
    if dtype == torch.float16:
        assert torch.equal(q_out, ref_q)
        for out, ref in zip(caches, ref_caches):
            _same(out, ref)
    else:
        torch.testing.assert_close(q_out, ref_q, atol=1e-6, rtol=1e-6)
        for out, ref in zip(caches, ref_caches):
            assert torch.equal(out.isnan(), ref.isnan())
            torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), atol=1e-6, rtol=1e-6)


@runnable
def test_bf16_int64_indices_and_general_tables():
    """bf16 (the GPU model dtype) with int64 positions and slots, and tables whose halves differ (the kernel
    computes ``x * cos + rotate_half(x) * sin`` for any table, reading both halves). Bit for bit on a GPU; the
    interpreter truncates fp32 to bf16 instead of rounding, so there within an ulp per rounding step. v is
    copied, never rounded: exact everywhere."""
    q_out, ref_q, (kc, vc), (ref_kc, ref_vc) = _run(4, 2, 64, torch.bfloat16, torch.int64, seed=5,
                                                    general_tables=True)
    _same(vc, ref_vc)
    if DEVICE == "cuda":
        assert torch.equal(q_out, ref_q)
        _same(kc, ref_kc)
    else:
        torch.testing.assert_close(q_out, ref_q, atol=2e-2, rtol=2e-2)
        assert torch.equal(kc.isnan(), ref_kc.isnan())
        torch.testing.assert_close(kc.nan_to_num(), ref_kc.nan_to_num(), atol=2e-2, rtol=2e-2)


@runnable
def test_padding_rows_store_nothing():
    """A batch of padding rows only (slot -1, position 0, as the graph's static inputs hold them) leaves a
    NaN-poisoned cache as it was and still writes every q_out element."""
    heads, kv_heads, d = 4, 2, 16
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d, device=DEVICE)
    cos, sin = _tables(d, torch.float32)
    kc = torch.full((2, BS, kv_heads, d), float("nan"), device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    q_out = torch.full((3, heads, d), float("nan"), device=DEVICE)
    zeros = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    tr.rope_and_store(qkv, zeros, cos, sin, heads, kv_heads, d, kc, vc, zeros - 1, q_out)
    assert kc.isnan().all() and vc.isnan().all()
    torch.testing.assert_close(q_out, qkv[:, :heads * d].view(3, heads, d))  # position 0: cos 1, sin 0


@runnable
def test_rejects_a_qkv_of_another_shape():
    """The layout assumptions are checked, not trusted: a qkv narrower than the heads say fails in one line."""
    cos, sin = _tables(16, torch.float32)
    cache = torch.zeros(2, BS, 2, 16, device=DEVICE)
    idx = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="qkv"):
        tr.rope_and_store(torch.zeros(2, 100, device=DEVICE), idx, cos, sin, 4, 2, 16, cache, cache, idx,
                          torch.zeros(2, 4, 16, device=DEVICE))


@runnable
def test_supported():
    w = torch.zeros(2, 64, device=DEVICE)
    assert tr.supported(w, 64) and tr.supported(w.half(), 128) and tr.supported(w.bfloat16(), 64)
    assert not tr.supported(w, 63)  # rotate_half needs an even head_dim
    assert not tr.supported(w, 512)  # past MAX_HEAD_DIM
    assert not tr.supported(w.to(torch.int8), 64)


@pytest.mark.skipif(RUNNABLE, reason="the kernel runs in this process")
def test_the_module_in_a_fresh_interpreter():
    """This session imported triton before TRITON_INTERPRET=1 could be set: run the module where it can be."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not sm90",
                           str(Path(__file__))], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


