"""LoRA adapters served beside their base: many registered, up to ``max_loras`` resident, mixed in one batch.

Why not merge: one replica of a base serves every product fine-tuned from it, and an adapter is loaded or
dropped without a restart. The base weights stay as they are (packed for the fastest GEMM, or 4-bit codes); an
adapter adds ``scaling · B(A x)`` to the output of each projection it targets, only for the rows of the
requests that asked for it. A batch with no adapter in it runs the base path untouched.

Layout. The compact forward fuses q/k/v into one projection and gate/up into another, so the adapters are
stacked per *fused* projection, one slot per resident adapter:

- shrink ``A``: ``[slots, parts · R, in]``, the parts' A matrices one under the other (R = ``max_rank``; a
  smaller rank is zero-padded, an untargeted part is all zero);
- expand ``B``, stored transposed: ``[slots, parts · R, out]``, block-diagonal: part j's outputs read only part
  j's ranks; the adapter's scaling (``lora_alpha / r``, or ``/ √r`` with rsLoRA) is folded in when it is written.
  Transposed, because the C++ kernel (``csrc/lora.cpp``) expands a row as R multiply-adds over contiguous outputs.

A step groups its rows by slot (``LoraBatch``) and runs, per projection and per adapter in the batch, one
gather, two small matmuls and one ``index_add_``: the segmented gather-matmul of Punica and S-LoRA, in torch.
Registered adapters live on the host (their A and B in fp32, a few MB for a rank-16 adapter of a small model);
``LoraManager`` keeps the resident set, least recently used out first, never an adapter a running request holds.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.engine.errors import LoraError
from serving.engine.lora_info import AdapterInfo

__all__ = ["ADAPTER_CONFIG", "FUSED", "LoraAdapter", "LoraBatch", "LoraError", "LoraManager", "LoraSlots",
           "load_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# the compact forward's fused projections and the HF modules each is made of, in output order
FUSED: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                     "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class LoraAdapter:
    """One PEFT LoRA adapter, read into host memory."""

    name: str
    path: str
    rank: int
    scaling: float
    # (layer, module) -> (A [r, in], B [out, r]) in fp32, for every module the adapter targets
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str  # sha256 of the weights file: the identity prefix caching keys on
    base_model: str = ""  # base_model_name_or_path of adapter_config.json, as written

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    @property
    def info(self) -> AdapterInfo:
        return AdapterInfo(self.name, self.path, self.rank, self.digest)


def _read_config(directory: Path) -> dict:
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise LoraError(f"{path}: missing (not a PEFT adapter directory)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise LoraError(f"{path}: unreadable ({exc})") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    unsupported = [
        (peft_type != "LORA", f"peft_type {peft_type!r} (only LORA)"),
        (bool(config.get("use_dora")), "use_dora (DoRA's magnitude vector)"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only 'none')"),
        (bool(config.get("modules_to_save")), f"modules_to_save {config.get('modules_to_save')}"),
        (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")),
         "per-module rank_pattern/alpha_pattern"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D-style weights)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise LoraError(f"{path}: {what} is not supported")
    return config


def _read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    for name in ADAPTER_WEIGHTS:
        path = directory / name
        if path.is_file():
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    return load_file(str(path)), path
                return torch.load(path, map_location="cpu", weights_only=True), path
            except Exception as exc:  # a corrupt file of either format: say which and why
                raise LoraError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    raise LoraError(f"{directory}: no {' or '.join(ADAPTER_WEIGHTS)}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _module_of(key: str) -> tuple[int, str, str] | None:
    """(layer, module, "lora_A" | "lora_B") of a PEFT weight name, e.g.
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``; None for anything else."""
    parts = key.split(".")
    try:
        at = parts.index("layers")
        layer = int(parts[at + 1])
    except (ValueError, IndexError):
        return None
    which = next((p for p in parts if p in ("lora_A", "lora_B")), None)
    module = parts[at + 3] if len(parts) > at + 3 else ""
    if which is None or module not in PARENT:
        return None
    return layer, module, which


def load_adapter(name: str, directory: str | Path, *, max_rank: int,
                 shapes: dict[str, tuple[int, int]] | None = None, num_layers: int | None = None) -> LoraAdapter:
    """Read a PEFT LoRA adapter directory. ``shapes``: module -> (out, in) of the base, and ``num_layers``: the
    base's layer count, both checked when given (an adapter trained on another base must not load)."""
    directory = Path(directory)
    config = _read_config(directory)
    tensors, weights_path = _read_tensors(directory)
    rank = int(config.get("r", 0))
    if not 0 < rank <= max_rank:
        raise LoraError(f"{directory / ADAPTER_CONFIG}: rank r={rank} is outside 1..max_lora_rank ({max_rank})")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        where = _module_of(key)
        if where is None:
            raise LoraError(f"{weights_path}: tensor {key!r} is not a LoRA weight of a Llama projection "
                            f"(targets must be among {', '.join(PARENT)})")
        layer, module, which = where
        pairs.setdefault((layer, module), {})[which] = tensor.detach().to(torch.float32).contiguous()
    if not pairs:
        raise LoraError(f"{weights_path}: no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoraError(f"{weights_path}: layer {layer} {module} has only {', '.join(ab)}")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(f"{weights_path}: layer {layer} {module}: A {tuple(a.shape)}, B {tuple(b.shape)} do "
                            f"not match rank {rank}")
        if num_layers is not None and not 0 <= layer < num_layers:
            raise LoraError(f"{weights_path}: layer {layer} {module}, but the base has {num_layers} layers")
        if shapes is not None and (b.shape[0], a.shape[1]) != shapes[module]:
            raise LoraError(f"{weights_path}: layer {layer} {module} is {b.shape[0]}×{a.shape[1]}, the base's is "
                            f"{shapes[module][0]}×{shapes[module][1]} (an adapter of another base)")
        weights[(layer, module)] = (a, b)
    return LoraAdapter(name, str(directory), rank, scaling, weights, _sha256(weights_path),
                       str(config.get("base_model_name_or_path") or ""))


class LoraSlots:
    """The resident adapters' weights, stacked per layer and fused projection (module docstring)."""

    def __init__(self, layout: dict[str, list[int]], in_features: dict[str, int], num_layers: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """``layout``: fused projection -> the output size of each of its parts (q, k, v for "qkv")."""
        self.layout, self.max_rank, self.max_loras = layout, max_rank, max_loras
        # per fused projection, each part's (output offset, output size, first rank column): what the C++ kernel
        # reads of the block-diagonal expand
        self.parts: dict[str, torch.Tensor] = {}
        for fused, outs in layout.items():
            starts = [sum(outs[:j]) for j in range(len(outs))]
            self.parts[fused] = torch.tensor([[start, out, j * max_rank] for j, (start, out)
                                              in enumerate(zip(starts, outs, strict=True))], dtype=torch.long)
        self.shrink: list[dict[str, torch.Tensor]] = []
        self.expand: list[dict[str, torch.Tensor]] = []
        for _ in range(num_layers):
            self.shrink.append({p: torch.zeros(max_loras, len(outs) * max_rank, in_features[p], dtype=dtype,
                                               device=device) for p, outs in layout.items()})
            self.expand.append({p: torch.zeros(max_loras, len(outs) * max_rank, sum(outs), dtype=dtype,
                                               device=device) for p, outs in layout.items()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.shrink + self.expand for t in layer.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` (whatever was there is overwritten; untargeted parts read zero)."""
        r, R = adapter.rank, self.max_rank
        for layer in range(len(self.shrink)):
            for fused, modules in FUSED.items():
                shrink, expand = self.shrink[layer][fused][slot], self.expand[layer][fused][slot]
                shrink.zero_()
                expand.zero_()
                row = 0
                for j, (module, out) in enumerate(zip(modules, self.layout[fused], strict=True)):
                    pair = adapter.weights.get((layer, module))
                    if pair is not None:
                        a, b = pair
                        shrink[j * R:j * R + r].copy_(a)
                        expand[j * R:j * R + r, row:row + out].copy_((b * adapter.scaling).T)
                    row += out


@dataclass
class LoraBatch:
    """Which rows of a step each resident adapter serves, rows of the base left out: per adapter either one
    run of rows (``start, stop``: the scheduler puts an adapter's requests side by side, so this is the usual
    case, read and written as slices) or, where they are apart, their indices (gathered and scattered)."""

    runs: list[tuple[int, int, int]]  # (slot, start, stop)
    scattered: list[tuple[int, torch.Tensor]]  # (slot, row indices)
    row_slots: torch.Tensor | None = None  # int64 [T], -1 for the base's rows: what the C++ kernel reads

    @classmethod
    def from_row_slots(cls, row_slots: list[int], device: torch.device) -> LoraBatch | None:
        """None when no row uses an adapter (the base path runs untouched)."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        if not by_slot:
            return None
        runs, scattered = [], []
        for slot, rows in by_slot.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                runs.append((slot, rows[0], rows[-1] + 1))
            else:
                scattered.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))
        return cls(runs, scattered, torch.tensor(row_slots, dtype=torch.long))

    def add(self, out: torch.Tensor, x: torch.Tensor, shrink: torch.Tensor, expand: torch.Tensor) -> None:
        """``out[rows] += (x[rows] @ shrinkᵀ) @ expandᵀ`` of each adapter's slot, for its rows (in place; expandᵀ
        is what ``expand`` holds)."""
        for slot, start, stop in self.runs:
            out[start:stop].add_((x[start:stop] @ shrink[slot].T) @ expand[slot])
        for slot, rows in self.scattered:
            delta = (x.index_select(0, rows) @ shrink[slot].T) @ expand[slot]
            out.index_add_(0, rows, delta.to(out.dtype))


class LoraManager:
    """Registered adapters (host), the resident ones (slots, least recently used first) and who holds them.

    A running request holds its adapter (``hold``/``release``); a held adapter is never evicted, so the
    scheduler admits a request only while its adapter is resident, or a slot is free or evictable
    (``can_hold``). That keeps every step's adapters resident at once. Residency is keyed by name *and* weights
    digest, and a request keeps its ``LoraAdapter``: unloading a name refuses new requests for it while the ones
    already accepted finish on the weights they started with, even if the name is loaded again meanwhile."""

    def __init__(self, slots: LoraSlots, max_rank: int, shapes: dict[str, tuple[int, int]], num_layers: int) -> None:
        self.slots, self.max_rank, self.shapes, self.num_layers = slots, max_rank, shapes, num_layers
        self.registered: dict[str, LoraAdapter] = {}
        self.resident: OrderedDict[tuple[str, str], int] = OrderedDict()  # key -> slot, least recently used first
        self.holds: dict[tuple[str, str], int] = {}
        self.loads = 0  # adapters written into a slot (a reload after eviction counts again)

    def read(self, name: str, directory: str | Path) -> LoraAdapter:
        """Read and check an adapter for this base (slow: disk; call it off the engine loop)."""
        return load_adapter(name, directory, max_rank=self.max_rank, shapes=self.shapes, num_layers=self.num_layers)

    def register(self, adapter: LoraAdapter) -> None:
        if adapter.name in self.registered:
            raise LoraError(f"adapter {adapter.name!r} is already loaded (unload it first)")
        self.registered[adapter.name] = adapter

    def unregister(self, name: str) -> LoraAdapter:
        """Refuse new requests for ``name``; its slot is reused once no running request holds it."""
        return self.registered.pop(name)

    def can_hold(self, adapter: LoraAdapter) -> bool:
        if _key(adapter) in self.resident:
            return True
        return len(self.resident) < self.slots.max_loras or any(not self.holds.get(k) for k in self.resident)

    def hold(self, adapter: LoraAdapter) -> int:
        """Make ``adapter`` resident (evicting the least recently used adapter nobody holds) and hold it."""
        key = _key(adapter)
        if key in self.resident:
            self.resident.move_to_end(key)
            slot = self.resident[key]
        else:
            slot = self._free_slot(adapter.name)
            self.slots.write(slot, adapter)
            self.resident[key] = slot
            self.loads += 1
        self.holds[key] = self.holds.get(key, 0) + 1
        return slot

    def release(self, adapter: LoraAdapter) -> None:
        key = _key(adapter)
        left = self.holds.get(key, 0) - 1
        if left > 0:
            self.holds[key] = left
            return
        self.holds.pop(key, None)
        if self.registered.get(adapter.name) is not adapter:  # unloaded (or replaced) meanwhile: free its slot
            self.resident.pop(key, None)

    @property
    def running(self) -> list[str]:
        """Names of the adapters running requests hold."""
        return sorted({name for (name, _), n in self.holds.items() if n})

    def _free_slot(self, name: str) -> int:
        used = set(self.resident.values())
        free = next((s for s in range(self.slots.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next((k for k in self.resident if not self.holds.get(k)), None)
        if victim is None:
            raise RuntimeError(f"no LoRA slot for {name!r}: all {self.slots.max_loras} are held")
        return self.resident.pop(victim)


def _key(adapter: LoraAdapter) -> tuple[str, str]:
    return adapter.name, adapter.digest
