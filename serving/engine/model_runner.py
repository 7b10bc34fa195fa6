"""Loads the model, owns the KV-cache tensors, turns a scheduler plan into one forward pass.

A plain Llama/Mistral/Qwen2 checkpoint is read straight into the compact forward's modules (``llama_checkpoint``:
no transformers modeling code, ~5 s less of every start); any other model is the Hugging Face definition (the
GPTQ/AWQ formats load through their libraries), with only its attention swapped for
``attention.paged_attention_forward`` through transformers' attention interface. Per step: build the flattened
input ids, positions, slot mapping and attention metadata, run the forward with ``logits_to_keep`` set to the rows
that need logits, and hand those logits back.

Which attention runs (``EngineConfig.attention_backend``):
- ``triton`` (the default on a GPU): paged kernels that read the block tables (``triton_attention``); the step's
  inputs go to the device in one pinned copy (``step_inputs``), and decode-only steps of the compact forward
  replay CUDA graphs (``cuda_graphs``) unless ``enforce_eager``;
- ``cpp`` (the default for fp32 on CPU): the C++ kernels (``cpu_kernels``) through the same hooks;
- ``torch``: SDPA over gathered blocks (``attention``), the reference the kernels are tested against.
The ``cpp`` and ``torch`` paths build a step's inputs from lists (``legacy_step_inputs``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from artifacts.common.device import pick_device
from serving.engine import attention, cpu_kernels
from serving.engine.attention import AttentionMetadata
from serving.engine.config import CPU_KV_MEMORY_BYTES, EngineConfig
from serving.engine.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs
from serving.engine.dequantize import dequantize_linears, is_quantized
from serving.engine.device_facts import probe, resolve_dtype
from serving.engine.device_memory import (
    CudaMemoryProbe,
    blocks_in_budget,
    kv_block_bytes,
    kv_cache_bytes,
    profile_forward,
)
from serving.engine.errors import ModelLoadError
from serving.engine.host_transfer import PinnedStaging
from serving.engine.int4_linear import Int4Linear
from serving.engine.legacy_step_inputs import build_legacy_inputs
from serving.engine.llama_checkpoint import load_plain
from serving.engine.lora import FUSED, LoraBatch, LoraManager, LoraSlots
from serving.engine.quantized_checkpoint import QuantizedLinear, is_quantized_dir, materialize_dense
from serving.engine.quantized_checkpoint import load_model as load_quantized
from serving.engine.scheduled_seq import ScheduledSeq
from serving.engine.step_inputs import DecodeStaticInputs, StepInputBuilder, StepInputs

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StepLogits:
    """Logits the sampler needs from one forward pass."""

    sample_rows: list[int]  # index into ``scheduled`` of sequences that sample a token now
    sample_logits: torch.Tensor | None  # [len(sample_rows), V]
    # (index into scheduled, first prompt position predicted, logits [n, V]) for prompt logprobs
    prompt_logits: list[tuple[int, int, torch.Tensor]]
    # index into scheduled -> logits [num_tokens, V] of every position it computed (speculation checks)
    verify_logits: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class TokenFill:
    """Input rows whose token the previous step sampled and the host has not seen yet (async scheduling): row
    ``rows[k]`` of this step's flattened input takes ``token_ids[src[k]]``, read on the device."""

    rows: list[int]
    src: list[int]
    token_ids: torch.Tensor  # the previous step's sampled ids, on the device


class ModelRunner:
    def __init__(self, model_dir: str | Path, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        if config.threads and self.device.type == "cpu":
            torch.set_num_threads(config.threads)
        self.device_facts = probe(self.device)
        self.dtype = _DTYPES[resolve_dtype(config.dtype, self.device_facts)]
        # a GPU's cache is sized from what the load leaves: its memory is read before the weights arrive
        memory = CudaMemoryProbe(self.device) if self._sized_by_device_memory() else None
        self.model = self._load(model_dir)
        self.compact = self._maybe_compact()
        hf = self.model.config
        text_cfg = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        self.num_layers = text_cfg.num_hidden_layers
        self.num_heads = text_cfg.num_attention_heads
        self.kv_heads = getattr(text_cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // self.num_heads
        self.vocab_size = text_cfg.vocab_size
        self.max_position = getattr(text_cfg, "max_position_embeddings", 2048)
        self.block_size = config.block_size
        self.lora = self._lora_manager() if config.max_loras else None
        self.cache_dtype = self.dtype if self.dtype in (torch.float32, torch.float16, torch.bfloat16) \
            else torch.float32
        self.decode_kernel = self.prefill_kernel = None
        self.triton = None  # the Triton kernels' module when they run attention (see the module docstring)
        self.builder: StepInputBuilder | None = None
        self.graphs: DecodeGraphs | None = None
        self._fill_staging = PinnedStaging(self.device, 64)  # the index pairs of a ``TokenFill``
        self.attention_backend = self._attention_backend()
        if self.attention_backend == "triton":  # before sizing: the profile forward runs what serving will run
            from serving.engine import triton_attention
            self.triton = triton_attention
            self.builder = StepInputBuilder(self.device, self.block_size)
            self.decode_kernel, self.prefill_kernel = triton_attention.paged_decode, triton_attention.paged_prefill
            if self.compact is not None:
                self._use_fused_kernels()
        self.num_blocks, self.cache_flag = self._num_blocks(memory)
        # per layer [num_blocks, block_size, kv_heads, head_dim], preallocated once
        self.k_caches = [torch.zeros(self.num_blocks, self.block_size, self.kv_heads, self.head_dim,
                                     dtype=self.cache_dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_caches = [torch.zeros_like(k) for k in self.k_caches]
        if self.attention_backend == "cpp":
            # decode attention straight from the blocks (C++, fp32 CPU); prefill and verify chunks likewise (block
            # size 16, the common head sizes), else SDPA per chunk
            kernels = cpu_kernels.load()
            self.decode_kernel = kernels.paged_decode
            self.prefill_kernel = kernels.paged_prefill if self.block_size == 16 \
                and self.head_dim in cpu_kernels.PREFILL_HEAD_DIMS else None
        if self.triton is not None and self.compact is not None and self.device.type == "cuda" \
                and not config.enforce_eager:
            self.enable_decode_graphs("graph")

    def _lora_manager(self) -> LoraManager:
        """Slots for ``max_loras`` resident adapters of rank ≤ ``max_lora_rank`` (serving.engine.lora)."""
        if self.compact is None:
            raise ModelLoadError("max_loras: LoRA adapters are served on the compact forward, which this model "
                                 "does not run (a plain Llama, Mistral or Qwen2 checkpoint does)")
        layout, in_features = self.compact.lora_layout()
        slots = LoraSlots(layout, in_features, self.num_layers, self.config.max_loras, self.config.max_lora_rank,
                          self.compact.embed.dtype, self.device)
        self.compact.lora_slots = slots
        shapes = {module: (out, in_features[fused]) for fused, modules in FUSED.items()
                  for module, out in zip(modules, layout[fused], strict=True)}
        log.info("LoRA: %d slots of rank ≤ %d (%.1f MB)", self.config.max_loras, self.config.max_lora_rank,
                 slots.nbytes / 1e6)
        return LoraManager(slots, self.config.max_lora_rank, shapes, self.num_layers)

    def _lora_rows(self, scheduled: list[ScheduledSeq]) -> LoraBatch | None:
        """Which rows of this step each resident adapter serves; None when none does (the base path)."""
        if self.lora is None or all(item.seq.lora_slot < 0 for item in scheduled):
            return None
        rows = [item.seq.lora_slot for item in scheduled for _ in range(item.num_tokens)]
        return LoraBatch.from_row_slots(rows, self.device)

    # ----------------------------------------------------------------- attention and graphs
    def _attention_backend(self) -> str:
        """``triton``, ``cpp`` or ``torch`` for this device and dtype (see the module docstring); an explicit
        ``triton`` that cannot run here is refused in one line."""
        wanted = self.config.attention_backend
        if wanted == "torch":
            return "torch"
        probe_cache = torch.empty(0, 1, self.kv_heads, self.head_dim, dtype=self.cache_dtype, device=self.device)
        try:
            from serving.engine import triton_attention
            why = None if triton_attention.supported(probe_cache, self.head_dim, self.block_size) else \
                f"{self.device.type} {str(self.cache_dtype).removeprefix('torch.')} cache, head_dim {self.head_dim}, " \
                f"block size {self.block_size} (needs a GPU, or TRITON_INTERPRET=1 on CPU)"
        except ImportError as e:
            why = f"triton is not importable ({e})"
        if why is None and (wanted == "triton" or self.device.type == "cuda"):
            return "triton"
        if wanted == "triton":
            raise ModelLoadError(f"attention_backend triton: cannot run here: {why}")
        if cpu_kernels.supported(probe_cache) and cpu_kernels.load() is not None:
            return "cpp"
        return "torch"

    def _use_fused_kernels(self) -> None:
        """The compact forward's fused Triton kernels where they apply (``CompactLlama.use_gpu_kernels``)."""
        from serving.engine import triton_norm, triton_rope

        weights = self.compact.embed
        rope = triton_rope.rope_and_store if triton_rope.supported(weights, self.head_dim) else None
        norm = triton_norm if triton_norm.supported(weights) else self.compact.norm_kernels
        self.compact.use_gpu_kernels(rope, norm)

    def enable_decode_graphs(self, replay: str = "graph") -> DecodeGraphs:
        """Capture (``replay="graph"``, a GPU) or set up eager replay over the same static inputs (``"eager"``:
        CPU tests of the graph's data flow) of decode-only steps; needs the Triton path and the compact forward."""
        if self.triton is None or self.compact is None:
            raise RuntimeError("decode graphs need the triton attention backend and the compact forward")
        c = self.config
        max_batch = min(c.max_num_seqs, c.max_num_batched_tokens, MAX_GRAPH_BATCH)
        max_len = min(self.max_position, self.num_blocks * self.block_size, c.max_model_len or self.max_position)
        static = DecodeStaticInputs(self.device, self.block_size, max_batch, -(-max_len // self.block_size))
        self.graphs = DecodeGraphs(self._forward, static, replay)
        self.graphs.capture()
        return self.graphs

    # ----------------------------------------------------------------- loading
    def _sized_by_device_memory(self) -> bool:
        """No flag fixes the cache and the device is a GPU: ``gpu_memory_utilization`` sizes it."""
        c = self.config
        return c.num_blocks is None and c.kv_memory_bytes is None and self.device.type == "cuda"

    def _load(self, model_dir: str | Path) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: not a model directory (config.json missing)")
        self.codes: dict[torch.nn.Module, QuantizedLinear] = {}
        if self.config.model_impl != "hf":  # a plain Llama-family checkpoint: no transformers modeling at all
            plain = load_plain(path, self.dtype, self.device)
            if plain is not None:
                return plain
        impl = attention.register()
        if is_quantized_dir(path) and (self.device.type == "cuda" or self.config.attention_backend == "triton"):
            # GPTQ/AWQ on the GPU path: read the 4-bit codes ourselves (the Triton kernel serves them; gptqmodel need
            # not be installed); a layout the reader refuses goes the library's way below
            try:
                model, self.codes = load_quantized(path, self.dtype, self.device, impl)
                return model
            except ValueError as e:
                log.warning("%s: serving through gptqmodel instead of our 4-bit kernel: %s", path, e)
        try:
            with _library_output_to_log(path):
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype, attn_implementation=impl)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{path}: cannot load model: {e}") from e
        model.to(self.device)
        model.eval()
        model.requires_grad_(False)
        return model

    def _maybe_compact(self):
        """The compact forward when the config allows it and the checkpoint supports it (see compact_llama)."""
        from serving.engine.compact_llama import CompactLlama, unsupported_reason

        if self.codes and (self.config.model_impl == "hf" or self.config.dequantize
                           or unsupported_reason(self.model) is not None):
            materialize_dense(self.codes, self.dtype)  # the HF forward needs dense weights
            self.codes = {}
        if self.config.model_impl == "hf":
            return None
        group_scales = {}
        if is_quantized(self.model) and self.device.type == "cpu":
            group_scales = dequantize_linears(self.model, torch.float32)  # see serving.engine.dequantize for why
        why = unsupported_reason(self.model)
        if why is not None:
            if self.config.model_impl == "compact":
                raise ModelLoadError(f"model_impl: compact path unavailable for this model: {why}")
            log.info("using the HF model forward (%s)", why)
            return None
        cfg = self.model.config
        kernels = cpu_kernels.load() if cpu_kernels.supported(self.model.lm_head.weight) else None
        # the 4-bit kernels take fp32 activations: other dtypes keep the dequantized weights
        if self.config.dequantize or self.dtype != torch.float32:
            group_scales = {}
        compact = CompactLlama(self.model, getattr(cfg, "max_position_embeddings", 2048), kernels, group_scales,
                               self.codes)
        if self.codes:
            log.info("4-bit weights: %d projections served from 4-bit codes by the Triton kernel (%.1f MB)",
                     len(compact.projections), sum(p.nbytes for p in compact.projections) / 1e6)
            self.codes = {}  # the unpacked codes (a byte a weight) go; the kernel's packed copy stays
            torch.cuda.empty_cache()
        if group_scales:
            packed = [p for p in compact.projections if isinstance(p, Int4Linear)]
            log.info("4-bit weights: %d of %d projections served from 4-bit codes (%.1f MB; %.1f MB as fp32)",
                     len(packed), len(compact.projections), sum(p.nbytes for p in packed) / 1e6,
                     sum(p.out_features * p.in_features * 4 for p in packed) / 1e6)
        return compact

    def _num_blocks(self, memory: CudaMemoryProbe | None) -> tuple[int, str]:
        """The cache's blocks, and the flag that sized it (error messages name it): ``--num-blocks``, a fixed
        budget (``--kv-memory``, or the CPU default), or the GPU's free memory (``device_memory``)."""
        c = self.config
        if c.num_blocks is not None:
            return c.num_blocks, "--num-blocks"
        elem = torch.tensor([], dtype=self.cache_dtype).element_size()
        per_block = kv_block_bytes(self.num_layers, self.block_size, self.kv_heads, self.head_dim, elem)
        if memory is None:
            return blocks_in_budget(c.kv_memory_bytes or CPU_KV_MEMORY_BYTES, per_block, "--kv-memory"), \
                "--kv-memory"
        facts = memory.measure(lambda: profile_forward(self, c.max_num_batched_tokens, c.max_num_seqs))
        budget = kv_cache_bytes(facts, c.gpu_memory_utilization)
        n = blocks_in_budget(budget, per_block, "--gpu-memory-utilization")
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB) from %g of %s's %.1f GiB, after the weights (%.2f GiB) "
                 "and the activation peak (%.2f GiB)", n, self.block_size, n * per_block / 2 ** 30,
                 c.gpu_memory_utilization, self.device_facts.describe(), facts.total / 2 ** 30,
                 facts.weights / 2 ** 30, facts.activation_peak / 2 ** 30)
        return n, "--gpu-memory-utilization"

    # ----------------------------------------------------------------- forward
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], sample_flags: list[bool],
                verify: list[bool] | None = None, fill: TokenFill | None = None) -> StepLogits:
        """One forward over the plan. ``sample_flags[i]``: scheduled[i] samples a token this step;
        ``verify[i]``: return the logits of every position scheduled[i] computed (guessed tokens to check);
        ``fill``: input rows that take the previous step's sampled ids from the device."""
        keep: list[int] = []
        sample_rows: list[int] = []
        prompt_spans: list[tuple[int, int, int, int]] = []  # sched idx, first prompt pos, keep lo, keep hi
        row = 0
        for i, item in enumerate(scheduled):
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                # row r predicts token at position start+r+1; keep those still inside the prompt
                last = min(start + n, seq.num_prompt_tokens - 1)
                lo = len(keep)
                keep.extend(range(row, row + (last - start)))
                prompt_spans.append((i, start + 1, lo, len(keep)))
            row += n
        n_prompt_rows = len(keep)
        row = 0
        for i, item in enumerate(scheduled):
            row += item.num_tokens
            if sample_flags[i]:
                keep.append(row - 1)
                sample_rows.append(i)
        verify_spans: list[tuple[int, int, int]] = []
        row = 0
        for i, item in enumerate(scheduled):
            if verify is not None and verify[i]:
                lo = len(keep)
                keep.extend(range(row, row + item.num_tokens))
                verify_spans.append((i, lo, len(keep)))
            row += item.num_tokens
        if not keep:
            keep = [0]
        lora = self._lora_rows(scheduled)
        if lora is not None:
            self.compact.lora_batch = lora
        try:
            if self.builder is not None:
                every_row = len(keep) == row and keep == list(range(row))  # e.g. a decode-only step, all sampling
                if every_row and self.graphs is not None and lora is None \
                        and all(item.num_tokens == 1 for item in scheduled) and self.graphs.fits(scheduled):
                    logits = self.graphs.run(scheduled, lambda ids: self._fill_inputs(ids, fill))
                else:
                    inputs = self.builder.build(scheduled, None if every_row else keep)
                    self._fill_inputs(inputs.input_ids, fill)
                    logits = self._forward(inputs)
            else:
                logits = self._forward_legacy(scheduled, keep, fill)
        finally:
            if lora is not None:
                self.compact.lora_batch = None
        sample_logits = logits[n_prompt_rows:n_prompt_rows + len(sample_rows)] if sample_rows else None
        prompt_logits = [(i, first, logits[lo:hi]) for i, first, lo, hi in prompt_spans]
        return StepLogits(sample_rows, sample_logits, prompt_logits,
                          {i: logits[lo:hi] for i, lo, hi in verify_spans})


    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """fp32 logits of the kept rows, from inputs already on the device (the Triton path; what a decode graph
        captures)."""
        t = self.triton
        meta = AttentionMetadata(self.k_caches, self.v_caches, inputs.slot_mapping, num_decode=inputs.num_decode,
                                 block_size=self.block_size, store_kv=t.store_kv)
        if inputs.num_decode:
            meta.decode_kernel = t.paged_decode
            meta.decode_block_tables, meta.decode_lens = inputs.decode_block_tables, inputs.decode_lens
        if inputs.prefill_row_starts is not None:
            meta.prefill_kernel = t.paged_prefill
            meta.prefill_block_tables = inputs.prefill_block_tables
            meta.prefill_row_starts, meta.prefill_first_pos = inputs.prefill_row_starts, inputs.prefill_first_pos
        if self.compact is not None:
            return self.compact(inputs.input_ids, inputs.positions, meta, inputs.keep).float()
        out = self.model(input_ids=inputs.input_ids[None], position_ids=inputs.positions[None], use_cache=False,
                         logits_to_keep=0 if inputs.keep is None else inputs.keep, paged_metadata=meta)
        return out.logits[0].float()

    def _fill_inputs(self, input_ids: torch.Tensor, fill: TokenFill | None) -> None:
        """Write the previous step's sampled ids into the rows that wait for them, on the device: two index vectors
        in one staged copy, one gather, one scatter; the host never reads the ids."""
        if fill is None:
            return
        n = len(fill.rows)
        staging = self._fill_staging
        staging.reserve(2 * n)
        staging.array[:n] = fill.rows
        staging.array[n:2 * n] = fill.src
        staging.upload(2 * n)
        rows, src = staging.dev[:n].long(), staging.dev[n:2 * n].long()
        input_ids.view(-1).index_put_((rows,), fill.token_ids[src].to(input_ids.dtype))

    def _forward_legacy(self, scheduled: list[ScheduledSeq], keep: list[int],
                        fill: TokenFill | None = None) -> torch.Tensor:
        """fp32 logits of the ``keep`` rows on the torch or C++ attention path (inputs built from lists)."""
        input_ids, positions, meta = build_legacy_inputs(scheduled, self.k_caches, self.v_caches, self.block_size,
                                                         self.device, self.decode_kernel, self.prefill_kernel)
        self._fill_inputs(input_ids, fill)
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        if self.compact is not None:
            return self.compact(input_ids[0], positions[0], meta, keep_t).float()
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                         logits_to_keep=keep_t, paged_metadata=meta)
        return out.logits[0].float()


def _library_output_to_log(path: Path) -> contextlib.AbstractContextManager[None]:
    """For a GPTQ/AWQ checkpoint, gptqmodel's banner and kernel-selection lines go to a log file in the temp
    directory while it loads (the server's output says where); other checkpoints load as they are."""
    from artifacts.common.quiet import is_quantized_checkpoint, output_to_log

    if not is_quantized_checkpoint(path):
        return contextlib.nullcontext()

    log_path = Path(tempfile.gettempdir()) / f"lifecycle-serve-{os.getpid()}-gptqmodel.log"
    return output_to_log(log_path, f"loading the quantized checkpoint {path.name} (gptqmodel)")
