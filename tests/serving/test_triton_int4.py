"""The Triton int4 linear (serving/engine/triton_int4.py): both kernels (the GEMV for one row, the tl.dot one for
more) equal ``x @ W.T (+ b)`` for the dequantized weight, over padded K, ragged N, every group size the layout
takes, fp32 and fp16 activations, fused projections, and codes read from a real GPTQ checkpoint.

Without a GPU the kernels run in Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports triton (triton decides when a kernel is decorated whether it compiles or interprets). With a
GPU the same tests run on it, bf16 activations as well.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from serving.engine import triton_int4
from serving.engine.triton_int4 import TritonInt4Linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.skipif(DEVICE == "cuda", reason="compiled for the GPU here")
def test_the_interpreter_is_on_for_cpu_runs():
    """Without it every kernel test below fails with "Cannot call @triton.jit'd outside of the scope of a kernel":
    triton's own library (tl.zeros) and our kernels must both have been decorated in interpreter mode."""
    assert all(isinstance(f, InterpretedFunction) for f in (tl.zeros, triton_int4._int4_gemv)), \
        "set TRITON_INTERPRET=1 before triton is first imported (tests/conftest.py does)"


def random_layer(n: int, k: int, group: int, seed: int = 0, scale_dtype: torch.dtype = torch.float16):
    """Codes, scales and zero points of an [n, k] layer, and its exact dequantized fp32 weight."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.05 + 0.005).to(scale_dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    weight = (codes.float().view(n, -1, group) - zeros.float()[..., None]) * scales.float()[..., None]
    return codes, scales, zeros, weight.view(n, k)


def assert_matches(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``y`` is ``x @ weight.T + bias`` up to the activations' precision (fp32: summation order only)."""
    ref = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert y.dtype == x.dtype and y.shape == ref.shape
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[x.dtype]
    err = (y.double() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5])  # the GEMV (one row); the tl.dot kernel (a 16-row tile, 11 rows masked)
@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("n,k,group,bias", [(48, 96, 32, False), (40, 320, 64, True), (32, 512, 128, True)])
def test_both_kernels_equal_the_dequantized_matmul(rows, dtype, n, k, group, bias):
    """K = 96 and 320 leave a partial 256-input block (padded codes, masked activations); N = 40 and 48 leave
    a partial block of outputs; group sizes 32..128 put one to eight groups in a block."""
    codes, scales, zeros, weight = random_layer(n, k, group)
    gen = torch.Generator().manual_seed(1)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    layer = TritonInt4Linear.from_codes(codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE),
                                        None if b is None else b.to(DEVICE))
    x = torch.randn(rows, k, generator=gen).to(dtype)
    y = layer(x.to(DEVICE)).cpu()
    # the tl.dot kernel rounds each dequantized weight to the activations' dtype, as a dequantized layer would
    w = weight if rows == 1 or dtype == torch.float32 else weight.to(dtype).float()
    assert_matches(y, x, w, b)


def test_the_gemv_serves_several_rows_when_told_to(monkeypatch):
    """``GEMV_MAX_ROWS`` (a tuning knob) sends small batches through the GEMV too: one program per row."""
    monkeypatch.setattr(triton_int4, "GEMV_MAX_ROWS", 4)
    codes, scales, zeros, weight = random_layer(32, 256, 32, seed=2)
    layer = TritonInt4Linear.from_codes(codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    assert_matches(layer(x.to(DEVICE)).cpu(), x, weight, None)


def test_a_fused_projection_is_its_parts_side_by_side():
    """QKV / gate-up fusion: the parts' codes, scales and zeros concatenated along N give the parts' outputs."""
    parts = [random_layer(n, 128, 32, seed=s) for s, n in enumerate((64, 32, 32))]
    fused = TritonInt4Linear.from_codes(*(torch.cat([p[i] for p in parts]).to(DEVICE) for i in range(3)))
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4))
    y = fused(x.to(DEVICE)).cpu()
    assert fused.out_features == 128 and fused.in_features == 128
    assert_matches(y, x, torch.cat([p[3] for p in parts]), None)


def test_codes_read_from_a_gptq_checkpoint(tiny_model_dir, tmp_path):
    """End to end on the layout gptqmodel writes: an RTN GPTQ checkpoint's codes, read back by our reader and
    packed for the kernel, give the projection of the checkpoint's dequantized weight."""
    from benchmarks.gptq_rtn import write_rtn_gptq_checkpoint
    from serving.engine.quantized_checkpoint import read_quantized_linears

    out = write_rtn_gptq_checkpoint(tiny_model_dir, tmp_path / "gptq", group_size=32, device="cpu")
    q = read_quantized_linears(out)["model.layers.0.mlp.down_proj"]
    layer = TritonInt4Linear.from_codes(q.codes.to(DEVICE), q.scales.to(DEVICE), q.zeros.to(DEVICE))
    x = torch.randn(1, q.in_features, generator=torch.Generator().manual_seed(5))
    assert_matches(layer(x.to(DEVICE)).cpu(), x, q.dequantize(torch.float32), None)


def test_the_packed_layout_and_its_bytes():
    """Half a byte a weight plus an fp16 scale and zero point per group; K padded to a whole 256-input block."""
    codes, scales, zeros, _ = random_layer(64, 512, 128)
    layer = TritonInt4Linear.from_codes(codes, scales, zeros)
    assert layer.qweight.dtype == torch.int32 and tuple(layer.qweight.shape) == (512 // 8, 64)
    assert layer.nbytes == 64 * 512 // 2 + 2 * (4 * 64 * 2)
    # nibble j of word row i of block 0 is input 32j + i
    word = layer.qweight[5, 7].item() & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [codes[7, 32 * j + 5].item() for j in range(8)]
    padded = TritonInt4Linear.from_codes(*random_layer(8, 96, 32)[:3])
    assert tuple(padded.qweight.shape) == (256 // 8, 8) and tuple(padded.scales.shape) == (256 // 32, 8)


def test_refuses_what_the_layout_cannot_hold():
    codes, scales, zeros, _ = random_layer(16, 96, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        TritonInt4Linear.from_codes(codes, scales, zeros)  # group size 48
    with pytest.raises(ValueError, match="one \\[N, K\\] weight"):
        TritonInt4Linear.from_codes(codes, scales, zeros[:8])
    layer = TritonInt4Linear.from_codes(*random_layer(16, 64, 32)[:3])
    with pytest.raises(ValueError, match="expected x"):
        layer(torch.zeros(2, 32))


@pytest.mark.parametrize("rows", [1, 5])
def test_a_call_is_one_allocation_and_one_launch_fixed_by_shapes(monkeypatch, rows):
    """What a captured CUDA graph relies on: no host sync, no torch op but the output's allocation, and a launch
    (grid and block sizes) that depends on the shapes alone, not on the values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, args[6:], meta))  # sizes and strides, not tensors

    monkeypatch.setattr(triton_int4, "_int4_gemv", Kernel())
    monkeypatch.setattr(triton_int4, "_int4_gemm", Kernel())
    layer = TritonInt4Linear.from_codes(*random_layer(48, 96, 32)[:3])
    inputs = torch.randn(rows, 96), torch.randn(rows, 96) * 100
    with Ops() as recorded:
        for x in inputs:
            layer(x)
    assert recorded.ops == ["aten.empty.memory_format"] * 2
    assert len(launches) == 2 and launches[0] == launches[1]


def test_the_engine_serves_a_gptq_checkpoint_from_its_codes_on_the_gpu_path(tiny_model_dir, tmp_path):
    """The GPU path end to end (the Triton attention and int4 kernels, here interpreted): a GPTQ checkpoint is read
    without gptqmodel, every projection served from its codes, and the greedy tokens are those of the CPU path,
    which loads the same checkpoint through gptqmodel and serves it from the C++ int4 kernel."""
    from benchmarks.gptq_rtn import write_rtn_gptq_checkpoint
    from serving.engine import EngineConfig, LLMEngine, SamplingParams

    gptq = write_rtn_gptq_checkpoint(tiny_model_dir, tmp_path / "gptq", group_size=32, device="cpu")
    prompts = [[10, 11, 12, 13], list(range(20, 45)), [5, 6, 7]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours = LLMEngine.from_pretrained(gptq, EngineConfig(device="cpu", num_blocks=64, max_model_len=64,
                                                        attention_backend="triton"))
    projections = ours.runner.compact.projections
    assert projections and all(isinstance(p, TritonInt4Linear) for p in projections)
    cpu = LLMEngine.from_pretrained(gptq, EngineConfig(device="cpu", num_blocks=64))
    assert [o.token_ids for o in ours.generate(prompts, greedy)] == \
        [o.token_ids for o in cpu.generate(prompts, greedy)]
