"""A GPTQ or AWQ checkpoint read straight from its safetensors files: per quantized linear, its 4-bit codes,
per-group scales and zero points, and a model built around them, with no quantization library.

Why: on CPU a 4-bit bundle loads through transformers + gptqmodel and ``serving.engine.dequantize`` recovers
the codes from gptqmodel's dequantized weights. A GPU machine may have no gptqmodel at all (the lent H100 has
none, and its CUDA build is the likeliest install failure), and gptqmodel's CUDA modules would run each
projection through their own kernels on the HF path anyway. The packed tensors are a documented, stable
format, so we read them ourselves and hand the exact codes to our own kernel (``serving.engine.triton_int4``).

Formats read (what gptqmodel 7.6 writes through ``quantize/backend.py``), with ``w[n, k]`` the weight of
output n and input k, and ``g = k // group_size``:
- GPTQ (``checkpoint_format`` ``gptq``, the v1 layout, or ``gptq_v2``): ``qweight`` int32 [K/8, N], code of
  (k, n) in bits 4*(k%8) of word [k//8, n]; ``qzeros`` int32 [G, N/8], zero of (g, n) in bits 4*(n%8) of word
  [g, n//8], stored minus one in v1; ``scales`` [G, N]; ``g_idx`` int32 [K], which must be k // group_size
  (act-order checkpoints whose groups are permuted are refused). ``w = scales[g, n] * (q - z)``.
- AWQ GEMM (``version``/``checkpoint_format`` ``gemm``, zero point on): ``qweight`` int32 [K, N/8] and
  ``qzeros`` int32 [G, N/8], both packed along N with the nibble j of word c holding column 8c + AWQ_ORDER[j];
  ``scales`` [G, N]; ``w = (q - z) * scales``.
Anything else (other bit widths or packings, act-order groups, a quantized output head) raises ValueError
naming the file and tensor or config key, and the caller keeps the library path.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from artifacts.errors import BundleError
from artifacts.safetensors_io import source_weight_files

__all__ = ["AWQ_ORDER", "QuantSpec", "QuantizedLinear", "is_quantized_dir", "load_model", "materialize_dense",
           "read_quantized_linears"]

BITS = 4
PACK = 32 // BITS  # codes per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble j of a word holds column 8c + AWQ_ORDER[j]
_FORMATS = {"gptq": ("gptq", "gptq_v2"), "awq": ("gemm",)}


@dataclass(frozen=True)
class QuantSpec:
    """What config.json's ``quantization_config`` says about the packed tensors, checked to be readable."""

    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group over all inputs
    checkpoint_format: str  # "gptq" (v1: zeros stored minus one), "gptq_v2" or "gemm"

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> QuantSpec:
        """Read ``config["quantization_config"]``; ValueError naming ``source`` and the key it cannot serve."""
        qc = config.get("quantization_config")
        if not isinstance(qc, dict):
            raise ValueError(f"{source}: no quantization_config")
        method = str(qc.get("quant_method", "")).lower()
        if method not in _FORMATS:
            raise ValueError(f"{source}: quant_method {method!r} is not read from codes (supported: gptq, awq)")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or qc.get("version") or _FORMATS[method][0])
        if fmt.lower() not in _FORMATS[method]:
            raise ValueError(f"{source}: {method} checkpoint_format {fmt!r} is not read from codes "
                             f"(supported: {', '.join(_FORMATS[method])})")
        if qc.get("bits") != BITS:
            raise ValueError(f"{source}: bits={qc.get('bits')!r}; only 4-bit checkpoints are read from codes")
        pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack_dtype != "int32":
            raise ValueError(f"{source}: pack_dtype {pack_dtype!r}; only int32 packing is read from codes")
        if qc.get("lm_head"):
            raise ValueError(f"{source}: lm_head=true; a quantized output head is not read from codes")
        group_size = qc.get("group_size", qc.get("q_group_size", -1))
        if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
            raise ValueError(f"{source}: group_size={group_size!r} is not a group size")
        if method == "awq" and (qc.get("zero_point") is False or qc.get("sym") is True):
            raise ValueError(f"{source}: AWQ without zero points is not read from codes")
        return cls(method, group_size, fmt.lower())


@dataclass
class QuantizedLinear:
    """One quantized linear as its exact 4-bit grid: ``w[n, k] = scales[n, g] * (codes[n, k] - zeros[n, g])``."""

    codes: torch.Tensor  # uint8 [out, in], 0..15
    scales: torch.Tensor  # [out, groups], the checkpoint's dtype (fp16 as gptqmodel writes it)
    zeros: torch.Tensor  # uint8 [out, groups], 0..15
    group_size: int  # inputs per group (the whole row when the checkpoint says -1)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [out, in]. In the scales' dtype (the default) it is bit for bit what gptqmodel's
        ``dequantize_weight`` / ``awq_weight_dequantize`` give: the same integer times the same scale, rounded
        once in that dtype. In any other dtype it is computed exactly in fp32 (a 4-bit integer times an fp16 or
        bf16 scale fits its mantissa) and rounded once to ``dtype``."""
        compute = self.scales.dtype if dtype in (None, self.scales.dtype) else torch.float32
        q = self.codes.view(self.out_features, -1, self.group_size).to(compute)
        z = self.zeros.to(compute).unsqueeze(-1)
        w = (q - z) * self.scales.to(compute).unsqueeze(-1)
        return w.view(self.out_features, self.in_features).to(dtype or compute)

    @staticmethod
    def cat(parts: list[QuantizedLinear]) -> QuantizedLinear:
        """Layers with the same inputs side by side (fused QKV or gate/up): one [sum of outs, in] layer."""
        if len({(p.in_features, p.group_size, p.scales.dtype) for p in parts}) != 1:
            raise ValueError("fused layers must share in_features, group_size and scale dtype")
        if len(parts) == 1:
            return parts[0]
        return QuantizedLinear(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.zeros for p in parts]), parts[0].group_size)


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read ({e})") from e


def is_quantized_dir(model_dir: str | Path) -> bool:
    """config.json declares a quantization_config (GPTQ, AWQ or any other; ``QuantSpec`` says if it is read)."""
    try:
        return _read_config(Path(model_dir)).get("quantization_config") is not None
    except ValueError:
        return False


def _unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W * 8]: nibble j of word w becomes element 8w + j (the words' little-endian
    bytes, low nibble first; done in bytes, it needs no int32 copy per code)."""
    b = words.contiguous().view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def _awq_columns(unpacked: torch.Tensor) -> torch.Tensor:
    """Undo AWQ's column order: element 8c + j of ``_unpack`` is column 8c + AWQ_ORDER[j]."""
    order = torch.tensor(AWQ_ORDER, device=unpacked.device)
    out = torch.empty_like(unpacked)
    out.view(*unpacked.shape[:-1], -1, PACK)[..., order] = unpacked.view(*unpacked.shape[:-1], -1, PACK)
    return out


class _Tensors:
    """Tensors of a model dir by name, from whichever safetensors file holds them (opened once each)."""

    def __init__(self, model_dir: Path, stack: contextlib.ExitStack, device: torch.device) -> None:
        from safetensors import safe_open

        try:
            self.files = source_weight_files(model_dir)
        except BundleError as e:  # no safetensors files, or a broken index
            raise ValueError(str(e)) from e
        self._open = {f: stack.enter_context(safe_open(str(f), framework="pt", device=str(device)))
                      for f in set(self.files.values())}

    def get(self, name: str) -> torch.Tensor:
        return self._open[self.files[name]].get_tensor(name)

    def where(self, name: str) -> str:
        return f"{self.files[name].name}: {name}"


def _expect(t: _Tensors, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    if name not in t.files:
        raise ValueError(f"{name}: missing from the checkpoint")
    tensor = t.get(name)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{t.where(name)}: shape {tuple(tensor.shape)}, expected {shape}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{t.where(name)}: dtype {tensor.dtype}, expected {dtype}")
    if dtype is None and not tensor.is_floating_point():
        raise ValueError(f"{t.where(name)}: dtype {tensor.dtype}, expected a float dtype")
    return tensor


def _read_linear(t: _Tensors, prefix: str, spec: QuantSpec) -> QuantizedLinear:
    qweight = t.get(f"{prefix}.qweight")
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"{t.where(prefix + '.qweight')}: expected a 2-d int32 tensor, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    if spec.method == "gptq":
        k, n = qweight.shape[0] * PACK, qweight.shape[1]
    else:
        k, n = qweight.shape[0], qweight.shape[1] * PACK
    group = k if spec.group_size == -1 else spec.group_size
    if k % group or n % PACK:
        raise ValueError(f"{t.where(prefix + '.qweight')}: {k} inputs and {n} outputs do not fit group size "
                         f"{group} and {PACK} codes per word")
    groups = k // group
    scales = _expect(t, f"{prefix}.scales", (groups, n), None)
    qzeros = _expect(t, f"{prefix}.qzeros", (groups, n // PACK), torch.int32)
    zeros = _unpack(qzeros)  # [G, N] (AWQ: in its column order)
    if spec.method == "gptq":
        g_idx = _expect(t, f"{prefix}.g_idx", (k,), torch.int32)
        if not torch.equal(g_idx, torch.arange(k, dtype=torch.int32, device=g_idx.device) // group):
            raise ValueError(f"{t.where(prefix + '.g_idx')}: groups are not k // {group} (an act-order "
                             "checkpoint); only contiguous groups are read from codes")
        codes = _unpack(qweight.T)  # [N, K]
        if spec.checkpoint_format == "gptq":  # v1 stores each zero point minus one
            if torch.any(zeros == 0xF):
                raise ValueError(f"{t.where(prefix + '.qzeros')}: a v1 zero point of 16 has no 4-bit code")
            zeros = zeros + 1
    else:
        codes = _awq_columns(_unpack(qweight)).T  # [N, K]
        zeros = _awq_columns(zeros)
    return QuantizedLinear(codes.contiguous(), scales.T.contiguous(), zeros.T.contiguous(), group)


def read_quantized_linears(model_dir: str | Path,
                           device: torch.device | str = "cpu") -> dict[str, QuantizedLinear]:
    """Every quantized linear of a GPTQ/AWQ checkpoint, by module name (``model.layers.0.self_attn.q_proj``),
    as its exact codes, scales and zero points, on ``device`` (read there and unpacked there: a GPU unpacks a
    1B model's codes in milliseconds). ValueError for what this reader does not support."""
    path = Path(model_dir)
    spec = QuantSpec.from_config(_read_config(path), str(path / "config.json"))
    with contextlib.ExitStack() as stack:
        tensors = _Tensors(path, stack, torch.device(device))
        prefixes = sorted(name.removesuffix(".qweight") for name in tensors.files if name.endswith(".qweight"))
        if not prefixes:
            raise ValueError(f"{path}: config.json declares {spec.method} but no tensor is named *.qweight")
        return {prefix: _read_linear(tensors, prefix, spec) for prefix in prefixes}


@contextlib.contextmanager
def _quiet_load_report() -> Iterator[None]:
    """transformers reports every packed tensor as unexpected and every quantized weight as missing (they are
    read here instead); keep that table out of the server's output."""
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
               attn_implementation: str | None = None) -> tuple[torch.nn.Module, dict[torch.nn.Module,
                                                                                      QuantizedLinear]]:
    """The HF model of a GPTQ/AWQ checkpoint, built without gptqmodel, and the codes of its quantized linears.

    The model is the plain architecture (``quantization_config`` removed from its config) with every tensor the
    checkpoint holds in dense form loaded by transformers (embeddings, norms, biases, the output head). Each
    quantized linear stays an ``nn.Linear`` whose weight is an empty [out, 0] placeholder (the right out size,
    no storage): its weights are the returned ``QuantizedLinear``, keyed by that module, on ``device``. A
    forward through the HF module tree needs ``materialize_dense`` first.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    linears = read_quantized_linears(path, device)
    config = AutoConfig.from_pretrained(str(path))
    del config.quantization_config
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with _quiet_load_report():  # the quantized weights are "missing": transformers initialises them, we drop them
        model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=dtype, **kwargs)
    codes: dict[torch.nn.Module, QuantizedLinear] = {}
    for name, q in linears.items():
        module = model.get_submodule(name)
        if not isinstance(module, torch.nn.Linear) or (module.out_features, module.in_features) != \
                (q.out_features, q.in_features):
            raise ValueError(f"{path}: quantized {name} [{q.out_features}, {q.in_features}] does not match the "
                             f"model's {module}")
        module.weight = torch.nn.Parameter(module.weight.new_empty(q.out_features, 0), requires_grad=False)
        codes[module] = q
    model.to(device)  # after the placeholders: the initialised dense copies never reach the device
    model.eval()
    model.requires_grad_(False)
    return model, codes


def materialize_dense(codes: dict[torch.nn.Module, QuantizedLinear], dtype: torch.dtype) -> None:
    """Give each placeholder linear of ``load_model`` its dequantized weight in ``dtype`` (computed exactly in
    fp32, rounded once) on the codes' device, for the HF forward: where the compact forward does not apply."""
    for module, q in codes.items():
        module.weight = torch.nn.Parameter(q.dequantize(dtype), requires_grad=False)
