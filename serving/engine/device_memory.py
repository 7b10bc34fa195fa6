"""How many KV blocks the engine gets, and the longest context it can then serve.

On a GPU the cache takes what the engine's share of the device leaves, as vLLM sizes it: the share is
``gpu_memory_utilization`` of the device's total memory; from it go the weights, the activation peak of a
profile forward at the largest step the scheduler can plan (``max_num_batched_tokens`` tokens, up to
``max_num_seqs`` sampled rows), and what this process holds outside torch's allocator; the rest, in whole
blocks, is the cache. A fixed budget (``--kv-memory``, or 256 MiB on CPU) is simply divided by the block size.

The arithmetic is pure (memory facts in, numbers out) so CPU CI checks it with planted numbers, a 7B model on
an 80 GB device included; ``CudaMemoryProbe`` gathers the real facts around the load and the profile pass.
Every refusal is one line that names the flag to change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from serving.engine.errors import ModelLoadError
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduled_seq import ScheduledSeq
from serving.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["CudaMemoryProbe", "MemoryFacts", "ProfiledRunner", "blocks_in_budget", "derive_max_model_len",
           "kv_block_bytes", "kv_cache_bytes", "profile_forward"]

_GIB = 2 ** 30


def _gib(n: float) -> str:
    return f"{n / _GIB:.2f} GiB"


def kv_block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one KV block across the model: keys and values of ``block_size`` tokens in every layer."""
    return num_layers * 2 * block_size * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class MemoryFacts:
    """One device's memory as measured after the weights loaded and the profile forward ran (bytes)."""

    total: int  # the device's memory
    weights: int  # what the loaded model holds (torch's allocations since before the load)
    activation_peak: int  # the profile forward's peak above what was allocated before it
    non_torch: int  # taken by this process outside torch's allocator since the load began (library workspaces)
    free: int  # free on the device now, after the profile's memory went back


def kv_cache_bytes(facts: MemoryFacts, utilization: float) -> int:
    """The KV cache's bytes: ``utilization`` of the device less the weights, the activation peak and the
    non-torch memory. Refuses (ModelLoadError) when nothing is left, or when other processes hold so much
    of the device that the cache would not fit in what is free."""
    share = int(utilization * facts.total)
    held = facts.weights + facts.activation_peak + facts.non_torch
    budget = share - held
    if budget <= 0:
        raise ModelLoadError(
            f"--gpu-memory-utilization {utilization:g}: {_gib(share)} of the device's {_gib(facts.total)} leave "
            f"nothing for the KV cache after the weights ({_gib(facts.weights)}), the activation peak "
            f"({_gib(facts.activation_peak)}) and other memory of this process ({_gib(facts.non_torch)}); raise "
            "--gpu-memory-utilization, or lower --max-num-batched-tokens")
    if budget > facts.free:
        most = int((facts.free + held) / facts.total * 100) / 100
        raise ModelLoadError(
            f"--gpu-memory-utilization {utilization:g}: the KV cache would take {_gib(budget)} but the device has "
            f"{_gib(facts.free)} free (other processes hold the rest); lower --gpu-memory-utilization to "
            f"{most:.2f} or less")
    return budget


def blocks_in_budget(budget: int, block_bytes: int, flag: str) -> int:
    """Whole blocks in ``budget``; a ModelLoadError naming ``flag`` when not even one fits."""
    n = budget // block_bytes
    if n < 1:
        raise ModelLoadError(f"{flag}: {budget} bytes hold no KV block (one block needs {block_bytes}); raise it")
    return int(n)


def derive_max_model_len(model_max: int, requested: int | None, num_blocks: int, block_size: int,
                         cache_flag: str) -> int:
    """The longest context a request may use: the user's ``--max-model-len``, else the model's
    (``max_position_embeddings``) capped by what the cache holds for one sequence. A requested length beyond
    either is refused (one line that says which flag to change; ``cache_flag`` is the one that sized the
    cache) rather than cut silently: a user who asks for 32k context should learn they cannot have it."""
    capacity = num_blocks * block_size
    if requested is None:
        return min(model_max, capacity)
    if requested > model_max:
        raise ModelLoadError(f"--max-model-len {requested}: the model's context is {model_max} tokens "
                             "(max_position_embeddings); lower --max-model-len")
    if requested > capacity:
        need = -(-requested // block_size)
        raise ModelLoadError(f"--max-model-len {requested}: needs {need} blocks of {block_size} tokens, the cache "
                             f"has {num_blocks}; lower --max-model-len or raise {cache_flag}")
    return requested


class SampledLogits(Protocol):
    """The one part of a step's result the profile reads: the sampling rows' logits."""

    @property
    def sample_logits(self) -> torch.Tensor | None: ...


class ProfiledRunner(Protocol):
    """What ``profile_forward`` needs of a model runner, stated here so that sizing the cache depends on this much
    and not on the runner's module (which sizes its cache through this one): the cache's geometry, the cache
    tensors themselves (swapped for a scratch pair during the profile, and put back; a runner that has not
    allocated its own yet may lack them) and one forward over a plan."""

    device: torch.device
    block_size: int
    cache_dtype: torch.dtype
    num_layers: int
    kv_heads: int
    head_dim: int
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]

    def execute(self, scheduled: list[ScheduledSeq], sample_flags: list[bool]) -> SampledLogits: ...


def profile_forward(runner: ProfiledRunner, num_tokens: int, num_seqs: int) -> int:
    """One forward and sampling-sized softmax at the largest step the scheduler can plan, on a scratch cache
    that is dropped afterwards: ``num_tokens`` tokens, one long prefill (its attention is the largest) and
    ``num_seqs - 1`` one-token prompts, every one sampling (the logits rows). The runner's own cache, if it
    has one, is left as it was. Returns the scratch cache's bytes, which the real cache stands in for, so
    the measured activation peak leaves them out."""
    import torch

    n = max(1, min(num_seqs, num_tokens))
    lengths = [1] * (n - 1) + [num_tokens - (n - 1)]  # the one-token prompts run as decodes, which go first
    bs = runner.block_size
    tables, next_block = [], 0
    for length in lengths:
        blocks = -(-length // bs)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    cache_dtype = runner.cache_dtype
    shape = (next_block, bs, runner.kv_heads, runner.head_dim)
    saved = getattr(runner, "k_caches", None), getattr(runner, "v_caches", None)
    runner.k_caches = [torch.zeros(shape, dtype=cache_dtype, device=runner.device) for _ in range(runner.num_layers)]
    runner.v_caches = [torch.zeros_like(k) for k in runner.k_caches]
    try:
        scheduled = []
        for i, (length, table) in enumerate(zip(lengths, tables)):
            seq = Sequence(f"profile-{i}", [0] * length, SamplingParams(max_tokens=1))
            seq.block_table = table
            scheduled.append(ScheduledSeq(seq, length))
        logits = runner.execute(scheduled, [True] * n).sample_logits
        logits.softmax(-1).sort(-1, descending=True)  # the sampler's largest temporaries (top-p sorts)
        return 2 * sum(k.numel() * k.element_size() for k in runner.k_caches)
    finally:
        runner.k_caches, runner.v_caches = saved


class CudaMemoryProbe:
    """Reads one CUDA device's memory around the load: made before the weights load, ``measure`` after it."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        torch.cuda.empty_cache()
        self.free_at_start, self.total = torch.cuda.mem_get_info(device)
        self.allocated_at_start = torch.cuda.memory_allocated(device)
        self.reserved_at_start = torch.cuda.memory_reserved(device)

    def measure(self, profile: Callable[[], int]) -> MemoryFacts:
        """Facts after the load, with ``profile`` run once to find the activation peak (it returns the bytes
        it allocated that are not activations: its scratch KV cache)."""
        import torch

        dev = self.device
        torch.cuda.synchronize(dev)
        weights = torch.cuda.memory_allocated(dev) - self.allocated_at_start
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        scratch = profile()
        torch.cuda.synchronize(dev)
        peak = max(0, torch.cuda.max_memory_allocated(dev) - before - scratch)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        grown = torch.cuda.memory_reserved(dev) - self.reserved_at_start  # what torch's allocator took since
        non_torch = max(0, self.free_at_start - free - grown)
        return MemoryFacts(total, weights, peak, non_torch, free)
