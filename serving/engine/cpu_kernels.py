"""Small C++ kernels for the CPU fp32 path, compiled on first use; the engine falls back to torch without them.

``paged_decode``: decode attention straight from the paged KV cache. The torch path
(``attention.paged_attention`` with decode groups) copies every decoding sequence's K/V blocks into a
padded tensor (``index_select``) and then runs SDPA over the copy, so the cache is read, written and read
again. This kernel reads each sequence's K and V once, block by block through its block table: per sequence
it scores every query head against the cached keys of its KV head (all KV heads of a block while the block
is in L1), takes the softmax (max-subtracted, a Cephes-style ``exp``), and sums the values. The common
shapes (query heads per KV head 4 or 8, head_dim 16/64/128) use 16-lane GCC vector extensions on AVX-512
hosts and AVX2 + FMA intrinsics on hosts without it (eight dot products reduced by one transpose, few
enough live registers that nothing spills: 2-2.8x the 16-lane path there); others a plain loop. Contiguous caches
``[num_blocks, block_size, kv_heads, head_dim]``.

``paged_prefill``: the same for prefill chunks and speculative verify chunks, all of a step's in one call: each
row attends causally to its sequence's cached keys up to its own position, read from the blocks (no gathered
copy, no mask tensor). Per (chunk, KV head, 16 rows) work item the keys are transposed once per block to
[head_dim][16], so a query's 16 scores per block are head_dim multiply-adds with no horizontal sums; an online
softmax keeps each query's accumulators, running max and sum in registers over the blocks (flash attention's
scheme). Items are dealt to the threads round-robin by cost. Block size 16, head_dim 16/32/64/128; else SDPA.

``add_rms_norm``: ``h += delta`` (the residual add, in place) and ``out = rms_norm(h) * weight`` in one pass.
``F.rms_norm`` on CPU runs as several ops. ``silu_mul``: the gated MLP's ``silu(gate) * up`` from the fused
gate/up projection in one pass (chunk, silu and mul were three ops and two temporaries per layer).

Measured on one thread with the bench model, against the torch ops they replace (``benchmarks/decode_step.py``
reproduces the step timings): the whole decode step at 64 sequences with contexts 32-512 from 42.8 to 28.9 ms
(30.3 ms with the attention kernel alone), 4.4 to 3.7 ms at one sequence; residual add + RMSNorm at hidden 512
from 36-60 to 5 µs at 64 rows; rotary of q and k per layer from 57 to 5.4 µs at 64 rows.

``lora_add``: the LoRA step of one fused projection for every row of a step in one call (``csrc/lora.cpp``; the
adapters' shrink and expand per row, reading only each part's own block of the block-diagonal B).

``tiled_pack`` / ``tiled_linear``: the fp32 projections' GEMM on CPUs where it beats the libraries
(``linear_backend`` chooses; ``csrc/tiled_gemm.cpp`` describes the layout and the two paths, one row and many).

``llama_layers``: every decoder layer of a step through the kernels above in one call from Python, where all the
projections are tiled (``CompactLlama`` decides per step; ``csrc/llama_layers.cpp`` says what it saves).

All of them split their work over threads with ``at::parallel_for``. The C++ is in ``csrc/``:
``paged_decode.cpp``, ``paged_prefill.cpp``, ``elementwise.cpp`` (add_rms_norm, silu_mul, rope),
``tiled_gemm.cpp``, ``lora.cpp``, ``llama_layers.cpp``, the shared 16-lane helpers in ``vec16.h``, and
``cpu_kernels.cpp``, which includes them (one translation unit: torch's headers are parsed once) and binds the
functions ``cpu_kernels.h`` declares; compiled by ``cpp_build.build`` when a C++ compiler is present. ``load()``
returns None, and the engine keeps the torch ops, when there is no compiler, the build fails, or
``LLM_LIFECYCLE_CPU_KERNELS=0``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from serving.engine import cpp_build
from serving.engine.cpp_build import ENV_SWITCH

__all__ = ["ENV_SWITCH", "PREFILL_HEAD_DIMS", "load", "supported"]

PREFILL_HEAD_DIMS = (16, 32, 64, 128)  # head sizes paged_prefill is compiled for (block size 16)

# the extension: one translation unit, and the files it includes (their bytes go into the build cache key)
SOURCE = cpp_build.CSRC / "cpu_kernels.cpp"
INCLUDES = tuple(cpp_build.CSRC / f for f in ("paged_decode.cpp", "paged_prefill.cpp", "elementwise.cpp",
                                              "tiled_gemm.cpp", "lora.cpp", "llama_layers.cpp", "cpu_kernels.h",
                                              "vec16.h"))

_kernels: ModuleType | None = None
_tried = False


def load() -> ModuleType | None:
    """The compiled module, or None: ``paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
    out)``, ``paged_prefill(q, k_cache, v_cache, block_tables, row_starts, first_pos, scale, out)``,
    ``add_rms_norm(h, delta_or_None, weight, eps, out)``, ``rope(qkv, positions, cos, sin, nq, nk,
    q_out, k_out)``, ``silu_mul(gu, out)``, ``tiled_pack(w)``, ``tiled_linear(x, tiles, out)``,
    ``tiled_gemm_available()``, ``lora_add(out, x, A, B, row_slots, parts, rank)`` and ``llama_layers(...)``
    (every decoder layer in one call; ``csrc/llama_layers.cpp`` gives its arguments)."""
    global _kernels, _tried
    if not _tried:
        _tried = True
        _kernels = cpp_build.build("llm_lifecycle_cpu_kernels", SOURCE, INCLUDES)
    return _kernels


def supported(t: torch.Tensor) -> bool:
    """Whether the kernels handle tensors like this one (fp32 on CPU)."""
    return t.device.type == "cpu" and t.dtype == torch.float32
