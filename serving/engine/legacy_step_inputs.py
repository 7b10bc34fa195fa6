"""A step's inputs for the torch and C++ attention paths: token ids, positions and ``AttentionMetadata``.

These paths (``attention_backend`` ``torch`` or ``cpp``) build every index tensor from Python lists, one
``torch.tensor`` each, which is fine where the host is the device or the forward is the reference the kernels
are tested against; the Triton path packs the same facts into one pinned copy instead (``step_inputs``). Kept
apart from the runner because it is the whole of the legacy path's batch preparation and reads nothing of the
runner but its cache tensors, block size, device and kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from serving.engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk, bucket_by_length
from serving.engine.scheduled_seq import ScheduledSeq

__all__ = ["build_legacy_inputs"]


def build_legacy_inputs(scheduled: list[ScheduledSeq], k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                        block_size: int, device: torch.device, decode_kernel: Callable[..., None] | None,
                        prefill_kernel: Callable[..., None] | None
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flattened ids/positions/slots plus attention metadata; decodes must come first. A kernel that is None
    leaves its part (decodes, prefill chunks) to SDPA over gathered blocks."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefill_specs: list[tuple[int, int, int, list[int]]] = []  # start, end, ctx_len, table
    num_decode = 0
    for item in scheduled:
        seq, n = item.seq, item.num_tokens
        start = seq.num_computed_tokens
        end = start + n
        table = seq.block_table
        row0 = len(ids)
        ids.extend(seq.token_ids[start:end])
        pos.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if n == 1 and not prefill_specs:
            decode_tables.append(table)
            decode_lens.append(end)
            num_decode += 1
        else:
            prefill_specs.append((row0, row0 + n, start, table))
    dev = device
    meta = AttentionMetadata(k_caches, v_caches,
                             torch.tensor(slots, dtype=torch.long, device=dev), num_decode=num_decode,
                             block_size=bs)
    if decode_kernel is not None and num_decode:
        nblk = max(len(t) for t in decode_tables)
        meta.decode_kernel = decode_kernel
        meta.decode_block_tables = torch.tensor([t + [0] * (nblk - len(t)) for t in decode_tables],
                                                dtype=torch.long, device=dev)
        meta.decode_lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
    # torch path: decodes of similar length share one padded gather (the kernel needs no groups); on a GPU
    # one group, since each group costs ~100 launches and its padding only microseconds of memory traffic
    if meta.decode_kernel is not None or not num_decode:
        groups = []
    elif dev.type == "cuda":
        groups = [list(range(num_decode))]
    else:
        groups = bucket_by_length(decode_lens, bs)
    for rows in groups:
        glens = [decode_lens[r] for r in rows]
        nblk = -(-max(glens) // bs)
        tab = [decode_tables[r][:nblk] + [0] * (nblk - min(len(decode_tables[r]), nblk)) for r in rows]
        mask = (torch.arange(nblk * bs)[None, :] < torch.tensor(glens)[:, None]).view(len(rows), 1, 1, -1)
        meta.decode_groups.append(DecodeGroup(torch.tensor(rows, dtype=torch.long, device=dev),
                                              torch.tensor(tab, dtype=torch.long).flatten().to(dev),
                                              mask.to(dev)))
    if prefill_kernel is not None and prefill_specs:
        nblk = max(-(-(start + row1 - row0) // bs) for row0, row1, start, _ in prefill_specs)
        meta.prefill_kernel = prefill_kernel
        meta.prefill_block_tables = torch.tensor(
            [table[:nblk] + [0] * (nblk - min(len(table), nblk)) for _, _, _, table in prefill_specs],
            dtype=torch.long, device=dev)
        meta.prefill_row_starts = torch.tensor([row0 - num_decode for row0, _, _, _ in prefill_specs]
                                               + [prefill_specs[-1][1] - num_decode], dtype=torch.long,
                                               device=dev)
        meta.prefill_first_pos = torch.tensor([start for _, _, start, _ in prefill_specs], dtype=torch.long,
                                              device=dev)
        prefill_specs = []  # the kernel takes them all in one call per layer
    for row0, row1, start, table in prefill_specs:
        if start == 0:
            meta.prefills.append(PrefillChunk(row0, row1))
            continue
        ctx = start + (row1 - row0)
        nblk = -(-ctx // bs)
        blocks = torch.tensor(table[:nblk], dtype=torch.long, device=dev)
        qpos = torch.arange(start, ctx)
        mask = (torch.arange(nblk * bs)[None, :] <= qpos[:, None]).to(dev)
        meta.prefills.append(PrefillChunk(row0, row1, blocks, mask))
    input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
    positions = torch.tensor([pos], dtype=torch.long, device=dev)
    return input_ids, positions, meta
