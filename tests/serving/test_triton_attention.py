"""The Triton paged-attention kernels under triton's CPU interpreter, against a float64 torch reference (that every
launch compiles for sm_90 within its shared memory is ``test_triton_sm90.py``'s).

Small shapes: the interpreter runs every program in numpy. Outputs are poisoned with NaN before each call, so an
element a kernel forgot to write fails the comparison. The interpreter must be switched on before triton is
first imported (``@triton.jit`` decides at decoration, and triton's own ``tl.max``, ``tl.sum``... are jitted
too). Run alone, this module does that itself; in a session where an earlier module already imported triton it
cannot, and then ``test_the_module_in_a_fresh_interpreter`` runs it again in a new process instead."""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from serving.engine import triton_attention as ta  # noqa: E402
from serving.engine.attention import AttentionMetadata, paged_attention  # noqa: E402

IN_PROCESS = isinstance(triton.language.max, InterpretedFunction)
if IN_PROCESS and not ta.interpreted():  # the kernel module alone was imported before the switch: decorate again
    ta = importlib.reload(ta)
in_process = pytest.mark.skipif(not IN_PROCESS, reason="triton was imported before TRITON_INTERPRET=1 was set: "
                                "test_the_module_in_a_fresh_interpreter runs these")
REPO = Path(__file__).resolve().parents[2]

BS = 16
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.float16: {"atol": 1e-2, "rtol": 1e-2}}
FAR_BLOCK = 2 ** 30  # a block id far outside any cache: reading it would fault


def _cache(num_blocks: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, BS, kv_heads, d, generator=gen).to(dtype),
            torch.randn(num_blocks, BS, kv_heads, d, generator=gen).to(dtype))


def _tables(ctx_lens: list[int], num_blocks: int, rng: random.Random) -> list[list[int]]:
    """Each context's blocks, dealt from a random permutation of the cache's blocks."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // BS))] for n in ctx_lens]


def _padded(tables: list[list[int]], dtype: torch.dtype = torch.int32, fill: int = 0) -> torch.Tensor:
    width = max(1, max(map(len, tables)))
    return torch.tensor([t + [fill] * (width - len(t)) for t in tables], dtype=dtype)


def _attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: list[int], q_pos: list[int],
            scale: float) -> torch.Tensor:
    """q [n, H, D] at positions q_pos, each row over its context positions 0..q_pos, in float64."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = kc.shape[2]
    k = kc[table].reshape(-1, kv_heads, d).double().repeat_interleave(heads // kv_heads, dim=1)
    v = vc[table].reshape(-1, kv_heads, d).double().repeat_interleave(heads // kv_heads, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(q_pos):
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k[:pos + 1]) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[:pos + 1])
    return out


@in_process
@pytest.mark.parametrize("dtype,num_splits", [(torch.float32, None), (torch.float16, None), (torch.float32, 1),
                                              (torch.float16, 2)])
@pytest.mark.parametrize("heads,kv_heads,d", [(2, 2, 16), (4, 2, 64), (8, 2, 16), (3, 1, 24)])
def test_decode_matches_reference(heads, kv_heads, d, dtype, num_splits):
    """Lengths 1, a block boundary and one past it, and five K/V tiles: split one tile each by default (5
    splits from these shapes), three and two over 2 splits, or all in one program writing the output itself
    (the large-batch path); the short rows leave splits empty. One query head per KV head up to four, and a
    head_dim padded to a power of two."""
    rng = random.Random(heads * d)
    lens = [1, 16, 17, 150, 5]
    kc, vc = _cache(sum(-(-n // BS) for n in lens) + 2, kv_heads, d, dtype)
    tables = _tables(lens, kc.shape[0], rng)
    q = torch.randn(len(lens), heads, d).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    assert ta.decode_splits(len(lens), kv_heads, 10, BS, q.device) == 5
    ta.paged_decode(q, kc, vc, _padded(tables), torch.tensor(lens, dtype=torch.int32), scale, out,
                    num_splits=num_splits)
    ref = torch.cat([_attend(q[b:b + 1], kc, vc, tables[b], [n - 1], scale) for b, n in enumerate(lens)])
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@in_process
@pytest.mark.parametrize("index_dtype,num_splits", [(torch.int32, 2), (torch.int64, 1)])
def test_decode_padding_rows_are_zero_and_read_nothing(index_dtype, num_splits):
    """Rows with seq_len 0 (padding of a graph batch) whose block tables point far outside the cache write
    zeros, through the combine kernel and straight from the split kernel; the real row between them stays
    right, the caches are untouched, and preallocated scratch is used as given. int64 tables and lengths (what
    the engine's metadata holds today) work too."""
    lens = [0, 40, 0]
    kc, vc = _cache(4, 2, 16, torch.float32)
    kc0, vc0 = kc.clone(), vc.clone()
    tables = torch.full((3, 4), FAR_BLOCK, dtype=index_dtype)
    tables[1, :3] = torch.tensor([2, 0, 3])
    q = torch.randn(3, 4, 16)
    scratch = ta.DecodeScratch.for_shape(3, 4, 16, num_splits, "cpu")
    for t in (scratch.acc, scratch.max, scratch.sum):
        t.fill_(float("nan"))
    out = torch.full_like(q, float("nan"))
    ta.paged_decode(q, kc, vc, tables, torch.tensor(lens, dtype=index_dtype), 0.25, out,
                    num_splits=num_splits, scratch=scratch)
    assert torch.equal(out[0], torch.zeros(4, 16)) and torch.equal(out[2], torch.zeros(4, 16))
    torch.testing.assert_close(out[1:2].double(), _attend(q[1:2], kc, vc, [2, 0, 3], [39], 0.25), **TOL[torch.float32])
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    assert (not scratch.sum.isnan().any()) == (num_splits > 1)  # partials went to the scratch given


def test_decode_splits_depend_on_shapes_only():
    """Batch 1 splits each KV head's context to fill the SMs, capped by the widest context's tiles; a large
    batch fills them without splitting."""
    cpu = torch.device("cpu")
    assert ta.decode_splits(1, 8, 128, 16, cpu) == 33  # ceil(2 * 132 / 8), under 2048 positions / 32 = 64 tiles
    assert ta.decode_splits(1, 8, 16, 16, cpu) == 8  # 256 positions: 8 tiles
    assert ta.decode_splits(1, 8, 2, 16, cpu) == 1  # one tile: nothing to split
    assert ta.decode_splits(4, 8, 1024, 16, cpu) == 9  # ceil(264 / 32)
    assert ta.decode_splits(64, 8, 1024, 16, cpu) == 1


def _prefill_case(specs: list[tuple[int, int]], heads: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int):
    """(cached tokens, chunk rows) per chunk → caches, tables, q, row starts and first positions."""
    rng = random.Random(seed)
    kc, vc = _cache(sum(-(-(c + n) // BS) for c, n in specs) + 3, kv_heads, d, dtype, seed)
    tables = _tables([c + n for c, n in specs], kc.shape[0], rng)
    rows = [0]
    for _, n in specs:
        rows.append(rows[-1] + n)
    q = torch.randn(rows[-1], heads, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return kc, vc, tables, q, rows, [c for c, _ in specs]


def _prefill_reference(q, kc, vc, tables, rows, first, scale):
    return torch.cat([_attend(q[rows[p]:rows[p + 1]], kc, vc, tables[p],
                              list(range(first[p], first[p] + rows[p + 1] - rows[p])), scale)
                      for p in range(len(tables))])


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d", [(2, 2, 16), (4, 2, 64), (8, 2, 16), (6, 2, 24)])
def test_prefill_matches_reference(heads, kv_heads, d, dtype):
    """Fresh chunks (one row, and past a query tile), chunks continuing a cached context off the block grid, and
    one-row chunks with a long context (a speculative verify, a decode taken as a chunk), in one call."""
    specs = [(0, 1), (0, 37), (21, 5), (100, 20), (33, 1), (150, 1), (7, 3)]
    kc, vc, tables, q, rows, first = _prefill_case(specs, heads, kv_heads, d, dtype, seed=heads + d)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    ta.paged_prefill(q, kc, vc, _padded(tables), torch.tensor(rows, dtype=torch.int32),
                     torch.tensor(first, dtype=torch.int32), scale, out)
    torch.testing.assert_close(out.double(), _prefill_reference(q, kc, vc, tables, rows, first, scale), **TOL[dtype])


@in_process
def test_prefill_single_long_chunk_int64_metadata():
    """One fresh prompt over several query and K/V tiles, with the int64 metadata the engine builds."""
    kc, vc, tables, q, rows, first = _prefill_case([(0, 150)], 4, 1, 16, torch.float32, seed=3)
    out = torch.full_like(q, float("nan"))
    ta.paged_prefill(q, kc, vc, _padded(tables, torch.int64), torch.tensor(rows), torch.tensor(first), 0.25, out)
    torch.testing.assert_close(out.double(), _prefill_reference(q, kc, vc, tables, rows, first, 0.25),
                               **TOL[torch.float32])


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_slots_and_skips_negative_ones(dtype):
    """Strided K/V rows (the attention hook's transposed views) into scattered slots; the -1 row writes
    nothing, and every other cache entry keeps its value."""
    kc, vc = _cache(6, 2, 24, dtype)
    kc0, vc0 = kc.clone(), vc.clone()
    k = torch.randn(2, 5, 24).to(dtype).transpose(0, 1)  # [T, KVH, D], not contiguous
    v = torch.randn(2, 5, 24).to(dtype).transpose(0, 1)
    slots = torch.tensor([17, -1, 3, 95, 40])  # nothing else writes slot 0, where -1 would land
    ta.store_kv(k, v, kc, vc, slots)
    keep = slots >= 0
    ref_k, ref_v = kc0.view(-1, 2, 24).clone(), vc0.view(-1, 2, 24).clone()
    ref_k[slots[keep]] = k[keep]
    ref_v[slots[keep]] = v[keep]
    assert torch.equal(kc.view(-1, 2, 24), ref_k) and torch.equal(vc.view(-1, 2, 24), ref_v)


@in_process
def test_kernels_fill_the_engine_hooks():
    """Through ``attention.paged_attention`` as the model runner wires it: the step's K/V stored, then decodes
    and prefill chunks of one flattened batch, int64 metadata, against the reference over the stored cache."""
    heads, kv_heads, d = 4, 2, 16
    dec_lens, specs = [9, 33], [(0, 6), (20, 4)]
    ctx = dec_lens + [c + n for c, n in specs]
    rng = random.Random(0)
    kc, vc = _cache(sum(-(-n // BS) for n in ctx) + 2, kv_heads, d, torch.float32)
    tables = _tables(ctx, kc.shape[0], rng)
    positions = [n - 1 for n in dec_lens] + [p for c, n in specs for p in range(c, c + n)]
    owners = [0, 1] + [2] * 6 + [3] * 4
    slots = torch.tensor([tables[o][p // BS] * BS + p % BS for o, p in zip(owners, positions)])
    t = len(positions)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    meta = AttentionMetadata([kc], [vc], slots, num_decode=2, block_size=BS, decode_kernel=ta.paged_decode,
                             decode_block_tables=_padded(tables[:2], torch.int64),
                             decode_lens=torch.tensor(dec_lens), prefill_kernel=ta.paged_prefill,
                             prefill_block_tables=_padded(tables[2:], torch.int64),
                             prefill_row_starts=torch.tensor([0, 6, 10]), prefill_first_pos=torch.tensor([0, 20]),
                             store_kv=ta.store_kv)
    out = paged_attention(q, k, v, 0, meta, None)
    assert torch.equal(kc.view(-1, kv_heads, d)[slots], k) and torch.equal(vc.view(-1, kv_heads, d)[slots], v)
    ref = torch.cat([_attend(q[i:i + 1], kc, vc, tables[o], [p], d ** -0.5)
                     for i, (o, p) in enumerate(zip(owners, positions))])
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_the_module_in_a_fresh_interpreter():
    """This session imported triton before TRITON_INTERPRET=1 could be set: run the module where it can be."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not sm90",
                           str(Path(__file__))], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


@in_process
def test_supported():
    cache = torch.zeros(2, 16, 2, 64)
    assert ta.supported(cache, 64, 16)
    assert ta.supported(cache.half(), 64, 16) and ta.supported(cache.bfloat16(), 64, 16)
    assert not ta.supported(cache, 64, 12)  # block size not a power of two
    assert not ta.supported(cache, 512, 16)  # head_dim past MAX_HEAD_DIM
    assert not ta.supported(cache.to(torch.int8), 64, 16)


