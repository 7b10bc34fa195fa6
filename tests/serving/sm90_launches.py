"""Compile what the engine's Triton launchers launch at the 1B benchmark model's shapes for an H100/H200 (sm_90),
with no GPU, and report each kernel's shared memory. Not a test module: ``test_triton_sm90.py`` runs it in a
subprocess, since it needs triton without the interpreter that the CPU test session switches on.

Why: the interpreter checks no resource limit. The first GPU run of the 4-bit GEMM died on the device with
"out of resource: shared memory, Required: 245760, Hardware limit: 232448" (a 128x128 tile, three pipeline
stages), which compiling with the device's specialisations reproduces here: integer arguments divisible by 16
and 16-byte-aligned pointers are specialised on the device (``tt.divisibility``), and that is what lets the
pipeliner buffer whole tiles. Launches are recorded on meta tensors (only shapes, strides and dtypes reach a
launch), then compiled with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``.

Prints one JSON line per launch: kernel, constexprs, num_warps, num_stages, shared bytes, and whether its global
loads are 16 bytes wide (``ld.global.v4.b32`` in the PTX: the memory-bound kernels must vectorise).
"""

from __future__ import annotations

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SHARED_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 (what the device reported)
SM_COUNT = 132
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8"}


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    names = [n for n in kernel.arg_names if n not in kwargs]
    sig, attrs = {}, {}
    for i, (name, arg) in enumerate(zip(names, args)):
        if isinstance(arg, torch.Tensor):
            sig[name] = "*" + _TYPES[arg.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 256-byte aligned
        elif isinstance(arg, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if arg % 16 == 0 and arg != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constants = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    sig |= dict.fromkeys(constants, "constexpr")
    return sig, constants, attrs


def compile_all(recorders: dict[str, Recorder]) -> list[dict]:
    rows = []
    for name, rec in recorders.items():
        for args, kwargs in rec.calls:
            sig, constants, attrs = _signature(rec.kernel, args, kwargs)
            options = {"num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3)}
            compiled = triton.compile(ASTSource(rec.kernel, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                                      options=options)
            rows.append({"kernel": name, "constants": {k: v for k, v in constants.items() if k.isupper()},
                         **options, "shared": compiled.metadata.shared,
                         "loads_16_bytes": "ld.global.v4.b32" in compiled.asm["ptx"]})
    return rows


def _patch(module, names: list[str]) -> dict[str, Recorder]:
    recorders = {}
    for name in names:
        recorders[name] = Recorder(getattr(module, name))
        setattr(module, name, recorders[name])
    return recorders


def int4_launches() -> dict[str, Recorder]:
    """The 4-bit linear at every row count the engine gives it (decode 1..256, prefill chunks up to 8192) for the
    1B model's projections (QKV 3072x2048, O 2048x2048, gate/up 16384x2048, down 2048x8192), group size 128."""
    from serving.engine import triton_int4 as ti

    ti._num_sms = lambda device: SM_COUNT
    recorders = _patch(ti, ["_int4_gemv", "_int4_gemm"])
    meta = {"device": "meta"}
    for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)):
        layer = ti.TritonInt4Linear(torch.empty(k // 8, n, dtype=torch.int32, **meta),
                                    torch.empty(k // 128, n, dtype=torch.float16, **meta),
                                    torch.empty(k // 128, n, dtype=torch.float16, **meta), None, k, 128)
        for m in (1, 4, 16, 64, 256, 300, 8192):
            layer(torch.empty(m, k, dtype=torch.bfloat16, **meta))
    return recorders


def attention_launches() -> dict[str, Recorder]:
    """Paged attention for 32 query heads over 8 KV heads, head_dim 64, block size 16: decode at 1 and 256
    sequences (split and single), a prefill step, the KV store."""
    from serving.engine import triton_attention as ta

    ta._sm_count = lambda device: SM_COUNT
    recorders = _patch(ta, ["_decode_split_kernel", "_decode_combine_kernel", "_prefill_kernel",
                            "_store_kv_kernel"])
    meta = {"device": "meta"}
    kc = torch.empty(1024, 16, 8, 64, dtype=torch.bfloat16, **meta)
    for batch in (1, 256):
        q = torch.empty(batch, 32, 64, dtype=torch.bfloat16, **meta)
        ta.paged_decode(q, kc, kc, torch.empty(batch, 256, dtype=torch.int32, **meta),
                        torch.empty(batch, dtype=torch.int32, **meta), 0.125, q)
    q = torch.empty(8192, 32, 64, dtype=torch.bfloat16, **meta)
    idx = torch.empty(17, dtype=torch.int32, **meta)
    ta.paged_prefill(q, kc, kc, torch.empty(16, 256, dtype=torch.int32, **meta), idx, idx[:16], 0.125, q)
    kv = torch.empty(8192, 8, 64, dtype=torch.bfloat16, **meta)
    ta.store_kv(kv, kv, kc, kc, torch.empty(8192, dtype=torch.int32, **meta))
    return recorders


def fused_launches() -> dict[str, Recorder]:
    """The compact forward's fused kernels at the 1B shapes: residual add + RMSNorm (hidden 2048), SiLU-gate
    (intermediate 8192), rotary + KV store (32 / 8 heads of 64), at 1 and 8192 rows."""
    from serving.engine import triton_norm as tn
    from serving.engine import triton_rope as tr

    recorders = _patch(tn, ["_add_rms_norm_kernel", "_silu_mul_kernel"]) | _patch(tr, ["_rope_store_kernel"])
    meta = {"device": "meta", "dtype": torch.bfloat16}
    for d in (64, 128):  # the 1B model's head_dim, and Llama-3 8B's
        tr.rope_and_store(torch.empty(16, 48 * d, **meta), torch.empty(16, dtype=torch.int32, device="meta"),
                          torch.empty(4096, 1, d, **meta), torch.empty(4096, 1, d, **meta), 32, 8, d,
                          torch.empty(64, 16, 8, d, **meta), torch.empty(64, 16, 8, d, **meta),
                          torch.empty(16, dtype=torch.int32, device="meta"), torch.empty(16, 32, d, **meta))
    cos = torch.empty(4096, 1, 64, **meta)
    kc = torch.empty(1024, 16, 8, 64, **meta)
    for t in (1, 8192):
        h = torch.empty(t, 2048, **meta)
        tn.add_rms_norm(h, torch.empty(t, 2048, **meta), torch.empty(2048, **meta), 1e-5, torch.empty(t, 2048, **meta))
        tn.silu_mul(torch.empty(t, 16384, **meta), torch.empty(t, 8192, **meta))
        tr.rope_and_store(torch.empty(t, 3072, **meta), torch.empty(t, dtype=torch.int32, device="meta"), cos, cos,
                          32, 8, 64, kc, kc, torch.empty(t, dtype=torch.int32, device="meta"),
                          torch.empty(t, 32, 64, **meta))
    return recorders


def gemv_launches() -> dict[str, Recorder]:
    """The dense GEMV (``LLM_LIFECYCLE_GPU_GEMV=triton``) on the 1B model's projections at one row, bf16: QKV
    3072x2048, O 2048x2048, gate/up 16384x2048, down 2048x8192, the head 32000x2048."""
    from serving.engine import triton_gemv as tg

    tg._num_sms = lambda device: SM_COUNT
    recorders = _patch(tg, ["_dense_gemv"])
    meta = {"device": "meta", "dtype": torch.bfloat16}
    for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (32000, 2048)):
        tg.dense_gemv(torch.empty(1, k, **meta), torch.empty(n, k, **meta))
    return recorders


GROUPS = {"int4": int4_launches, "attention": attention_launches, "fused": fused_launches, "gemv": gemv_launches}

if __name__ == "__main__":
    for group in sys.argv[1:]:
        for row in compile_all(GROUPS[group]()):
            print(json.dumps({"group": group, **row}), flush=True)
