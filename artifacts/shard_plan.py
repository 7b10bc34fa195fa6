"""Tensor-parallel ownership of a Llama-family checkpoint: which rank holds which slice of which tensor.

The rules are Megatron's, as vLLM applies them to Llama:
- q/k/v/gate/up projections are column-parallel: each rank owns a slice of the output features
  (fp `weight` dim 0, its `bias` dim 0; packed GPTQ/AWQ `qweight`/`qzeros`/`scales` dim 1, `g_idx`
  replicated because it indexes input features).
- o/down projections are row-parallel: each rank owns a slice of the input features (fp `weight` dim 1;
  packed tensors and `g_idx` dim 0); their bias is replicated (added once after the all-reduce).
- embed_tokens and lm_head are split by vocabulary rows when the vocab divides by the degree, and
  replicated otherwise. Our choice: the files are not padded (vLLM pads the vocab to a multiple of 64 x
  degree at load time); replicating an undividable vocab costs memory, never correctness.
- norms (and anything else 1-D per layer) are replicated.

Heads, as vLLM's `QKVParallelLinear` assigns them (degree = tp, H = attention heads, K = KV heads):
- H must divide by tp: rank r owns query heads [r*H/tp, (r+1)*H/tp).
- tp <= K: K must divide by tp, and rank r owns KV heads [r*K/tp, (r+1)*K/tp) (a partition).
- tp > K: tp must be a multiple of K, and each KV head is replicated on tp/K consecutive ranks: rank r
  owns KV head r // (tp/K), the one its query heads attend with. k/v projections are then sliced by
  whole heads, so ranks that share a head record the same range.
Any other degree is refused (vLLM refuses it too). `TPPlan.kv_heads[r]` records the KV heads of rank r.
A split dimension that does not divide by the degree (or a k/v dimension that does not divide into whole
heads) is refused, naming the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from artifacts.errors import BundleError
from artifacts.manifest import TensorSplit, TPPlan


class TPDegreeError(BundleError):
    """A TP degree does not fit the model; `tensor` names the offending tensor (None for head counts)."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        self.tensor = tensor
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.tensor)

_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias|qweight|qzeros|scales|g_idx)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.(weight|bias|qweight|qzeros|scales|g_idx)$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens\.weight|lm_head\.(weight|qweight|qzeros|scales|g_idx))$")
_KV = re.compile(r"\.(k_proj|v_proj)\.[a-z_]+$")


def split_rule(name: str, ndim: int) -> tuple[str, int | None]:
    """(kind, dim) for one tensor by its Llama-family name; ("replicate", None) when it is not split."""
    if match := _COLUMN.search(name):
        suffix = match.group(2)
        if suffix in ("weight", "bias"):
            return "column", 0
        if suffix == "g_idx":
            return "replicate", None
        return "column", 1  # packed tensors are stored [in, out]
    if match := _ROW.search(name):
        suffix = match.group(2)
        if suffix == "weight":
            return "row", 1
        if suffix == "bias":
            return "replicate", None
        return "row", 0
    if _VOCAB.search(name) and ndim == 2:
        return "vocab", 0 if name.endswith(".weight") else 1  # packed lm_head: [in, vocab]
    return "replicate", None


def kv_head_owners(degree: int, num_heads: int, num_kv_heads: int) -> list[list[int]]:
    """The KV heads each rank holds under `degree` (see the module docstring); refuses a degree vLLM refuses."""
    if degree < 1:
        raise TPDegreeError(f"tp degree {degree}: must be >= 1")
    if num_heads % degree:
        raise TPDegreeError(f"tp degree {degree}: num_attention_heads = {num_heads} is not divisible by {degree}")
    if degree <= num_kv_heads:
        if num_kv_heads % degree:
            raise TPDegreeError(f"tp degree {degree}: num_key_value_heads = {num_kv_heads} is not divisible by "
                                f"{degree} (KV heads are split evenly when the degree is at most their number)")
        per_rank = num_kv_heads // degree
        return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(degree)]
    if degree % num_kv_heads:
        raise TPDegreeError(f"tp degree {degree}: exceeds num_key_value_heads = {num_kv_heads} but is not a "
                            f"multiple of it (each KV head must be replicated on the same number of ranks)")
    replicas = degree // num_kv_heads
    return [[r // replicas] for r in range(degree)]


def plan_shards(
    shapes: Mapping[str, Sequence[int]], degree: int, num_heads: int, num_kv_heads: int
) -> TPPlan:
    """Per-rank ownership of every tensor for one TP degree; raises `TPDegreeError` if it does not fit."""
    kv_heads = kv_head_owners(degree, num_heads, num_kv_heads)
    tensors: dict[str, TensorSplit] = {}
    for name in shapes:
        shape = list(shapes[name])
        kind, dim = split_rule(name, len(shape))
        if degree == 1 or kind == "replicate" or dim is None:
            tensors[name] = TensorSplit("replicate")
            continue
        size = shape[dim]
        if _KV.search(name):  # sliced by whole KV heads; ranks that share a head share its range
            if size % num_kv_heads:
                raise TPDegreeError(
                    f"tp degree {degree}: tensor {name} shape {shape} dim {dim} = {size} is not divisible by "
                    f"num_key_value_heads = {num_kv_heads}", tensor=name)
            per_head = size // num_kv_heads
            ranges = [[heads[0] * per_head, (heads[-1] + 1) * per_head] for heads in kv_heads]
            tensors[name] = TensorSplit(kind, dim, ranges)
            continue
        if size % degree:
            if kind == "vocab":
                tensors[name] = TensorSplit("replicate")
                continue
            raise TPDegreeError(
                f"tp degree {degree}: tensor {name} shape {shape} dim {dim} = {size} is not divisible by {degree}",
                tensor=name,
            )
        step = size // degree
        tensors[name] = TensorSplit(kind, dim, [[r * step, (r + 1) * step] for r in range(degree)])
    return TPPlan(degree=degree, tensors=tensors, kv_heads=kv_heads)

