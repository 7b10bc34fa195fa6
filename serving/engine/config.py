"""Engine configuration: one dataclass holding every engine knob and its default (`lifecycle serve` maps onto it)."""
# ruff: noqa: UP045 (the YAML loader contract spells optional fields Optional[...])

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

_DTYPES = ("float32", "float16", "bfloat16", "auto")
_ATTENTION_BACKENDS = ("auto", "triton", "torch")
# the KV cache's budget where no flag sizes it and the device is not a GPU (a GPU's comes from its free memory)
CPU_KV_MEMORY_BYTES = 256 * 1024 * 1024


@dataclass
class EngineConfig:
    """Knobs of the continuous-batching engine.

    The KV cache is sized by ``num_blocks`` (exact, used by tests that force preemption), else by
    ``kv_memory_bytes`` (a fixed budget, the way a deployment thinks about it), else by the device: on a GPU
    from ``gpu_memory_utilization`` (the share of the device's memory this engine may use, as in vLLM) once
    the weights are loaded and a profile forward has measured the activations; elsewhere
    ``CPU_KV_MEMORY_BYTES``. ``dtype="auto"`` is bf16 on a GPU that has it, fp16 on older GPUs, fp32 on CPU
    (``serving.engine.device_facts``).
    """

    block_size: int = 16
    kv_memory_bytes: Optional[int] = None
    num_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_queue: int = 256
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "auto"
    device: str = "auto"
    threads: Optional[int] = None
    # seeds the sampler's generator, which requests without their own ``seed`` draw from
    seed: int = 0
    # "auto": compact Llama forward when the checkpoint allows it, else HF; "hf" / "compact" force one
    model_impl: str = "auto"
    # GPTQ/AWQ snapshots on the compact path: False serves them from their 4-bit codes (serving.engine.int4_linear),
    # True from fp32 copies of the dequantized weights (about 5-8x the weight memory, fp32 speed)
    dequantize: bool = False
    # speculative decoding: tokens guessed per step for greedy requests (0 = off), by n-gram prompt lookup
    # unless ``speculative_model`` names a draft model
    speculative_tokens: int = 0
    speculative_ngram: int = 4  # longest context suffix looked up (down to 2 tokens)
    # a draft model (a local HF dir with the target's vocabulary) that guesses too (serving.engine.draft_model)
    speculative_model: Optional[str] = None
    # with a draft model: the n-gram lookup's guesses where the context repeats and they promise more than the
    # draft's, the draft's elsewhere (speculative.LookupThenDraft); False: the draft's alone
    speculative_lookup: bool = True
    # attention kernels: "auto" picks Triton's paged kernels on a GPU, the C++ ones for fp32 on CPU, torch ops
    # elsewhere; "triton" / "torch" force one (a benchmark's before/after, or a way around a kernel bug)
    attention_backend: str = "auto"
    # True: every step runs eagerly; False: decode-only steps on a GPU replay CUDA graphs captured per batch size
    enforce_eager: bool = False
    # one step in flight: the host applies step N and plans N+1 while the device computes N+1 (serving.engine.engine);
    # None: on for a GPU without speculative decoding, off on CPU (where the host is the device: nothing overlaps)
    async_scheduling: Optional[bool] = None
    # LoRA adapters (serving.engine.lora): how many are resident at once (0: adapters off), and their largest rank
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ValueError(f"kv_memory_bytes: must be > 0, got {self.kv_memory_bytes}")
        if isinstance(self.gpu_memory_utilization, bool) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1] (the share of the device's memory the "
                             f"engine may use), got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras: must be >= 0 and max_lora_rank >= 1, got {self.max_loras}, "
                             f"{self.max_lora_rank}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue: must be >= 0, got {self.max_queue}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1, got {self.max_model_len}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {_DTYPES}, got {self.dtype!r}")
        if self.model_impl not in ("auto", "hf", "compact"):
            raise ValueError(f"model_impl: must be 'auto', 'hf' or 'compact', got {self.model_impl!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"seed: must be an integer in [0, 2**64), got {self.seed!r}")
        if not 0 <= self.speculative_tokens <= 16:
            raise ValueError(f"speculative_tokens: must be in [0, 16], got {self.speculative_tokens}")
        if self.speculative_ngram < 2:
            raise ValueError(f"speculative_ngram: must be >= 2, got {self.speculative_ngram}")
        if self.async_scheduling and self.speculative_tokens:
            raise ValueError("async_scheduling: cannot be on with speculative decoding (guesses are made from tokens "
                             "the host has not seen while a step is in flight); turn one of them off")
        if self.speculative_model is not None:
            if not str(self.speculative_model).strip():
                raise ValueError("speculative_model: must be a model directory, got an empty string")
            if self.speculative_tokens < 1:
                raise ValueError("speculative_model: needs speculative_tokens >= 1 (the tokens the draft guesses "
                                 f"per step), got {self.speculative_tokens}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError("max_num_batched_tokens: must cover max_model_len when chunked prefill is off")
