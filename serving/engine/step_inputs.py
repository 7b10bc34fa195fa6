"""A step's integer inputs for the GPU path, built on the host in one pinned buffer and sent in one copy.

Why: building each index tensor with ``torch.tensor(list, device="cuda")`` is a pageable copy that blocks the host
until the GPU has taken it, several times per step, so the host never runs ahead of the GPU. Here every field of
a step (token ids, positions, KV slots, block tables and lengths for the attention kernels, the rows to keep
logits for) is written with numpy into one page-locked int32 buffer and sent with a single ``non_blocking``
copy; the tensors the forward reads are views of the device twin of that buffer. Nothing here waits for the GPU.

Two layouts share the machinery (``host_transfer.PinnedStaging``):
- ``StepInputBuilder`` packs any step (decodes, prefill chunks, verify chunks) field after field; the offsets
  move from step to step, so it serves eager forwards.
- ``DecodeStaticInputs`` keeps fixed offsets and widths (room for the largest batch of a CUDA graph), so a graph
  captured once reads the same addresses at every replay; rows past the batch are padding: no KV slot (-1), a
  context of length 0, which the Triton kernels skip.

Reusing a pinned buffer is safe because the staging alternates between two of them (``PinnedStaging.flip``) and
the engine keeps at most one step in flight: a buffer is written again only after the step that read it was
waited on (its sampled token ids, which come after the copy in stream order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from serving.engine.host_transfer import PinnedStaging
from serving.engine.scheduled_seq import ScheduledSeq

NO_SLOT = -1  # a padding row's KV slot: the store kernel writes nothing for it
ALIGN = 16  # int32s: every field of a step starts on a 64-byte boundary


@dataclass
class StepInputs:
    """Device views of one step's inputs (int32), rows ordered as the plan: decodes first, then chunks."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    num_decode: int
    decode_lens: torch.Tensor | None  # [D] context length including the step's token
    decode_block_tables: torch.Tensor | None  # [D, max blocks]
    prefill_row_starts: torch.Tensor | None  # [P + 1] from the first chunk row
    prefill_first_pos: torch.Tensor | None  # [P]
    prefill_block_tables: torch.Tensor | None  # [P, max blocks]
    keep: torch.Tensor | None  # rows whose logits are needed (None: every row)


def _slots(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return table[positions // block_size] * block_size + positions % block_size


class StepInputBuilder:
    """Packs a plan's inputs into a ``PinnedStaging`` for one eager forward (see the module docstring)."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.block_size = block_size
        self.staging = PinnedStaging(device)

    def build(self, scheduled: list[ScheduledSeq], keep: list[int] | None) -> StepInputs:
        """Inputs for ``scheduled``; ``keep`` lists the rows to compute logits for (None: all of them)."""
        bs = self.block_size
        num_tokens = sum(item.num_tokens for item in scheduled)
        num_decode = 0
        for item in scheduled:  # leading one-token items run as decodes (the scheduler puts them first)
            if item.num_tokens != 1:
                break
            num_decode += 1
        chunks = scheduled[num_decode:]
        dec_width = max((len(item.seq.block_table) for item in scheduled[:num_decode]), default=0)
        pre_width = max((len(item.seq.block_table) for item in chunks), default=0)
        sizes = [num_tokens, num_tokens, num_tokens, num_decode, num_decode * dec_width,
                 len(chunks) + 1 if chunks else 0, len(chunks), len(chunks) * pre_width,
                 len(keep) if keep is not None else 0]
        # every field starts 64 bytes in: a kernel's pointer alignment never changes with the step's sizes (triton
        # compiles a kernel again for each new alignment of its arguments)
        edges = np.concatenate([[0], np.cumsum([-(-n // ALIGN) * ALIGN for n in sizes])]).tolist()
        offsets = [(a, a + n) for a, n in zip(edges, sizes)]
        self.staging.reserve(edges[-1])
        buf = self.staging.array

        def field(i: int) -> np.ndarray:
            return buf[offsets[i][0]:offsets[i][1]]

        ids, pos, slots, lens = field(0), field(1), field(2), field(3)
        dec_tables = field(4).reshape(num_decode, dec_width)
        row = fill_decode_rows(scheduled[:num_decode], bs, ids, pos, slots, lens, dec_tables)
        starts, first, pre_tables = field(5), field(6), field(7).reshape(len(chunks), pre_width)
        for j, item in enumerate(chunks):
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            table = np.asarray(seq.block_table, dtype=np.int32)
            ids[row:row + n] = seq.token_ids[start:start + n]
            positions = np.arange(start, start + n, dtype=np.int32)
            pos[row:row + n] = positions
            slots[row:row + n] = _slots(table, positions, bs)
            starts[j] = row - num_decode
            first[j] = start
            pre_tables[j, :len(table)] = table
            row += n
        if chunks:
            starts[len(chunks)] = row - num_decode
        if keep is not None:
            field(8)[:] = keep
        self.staging.upload(edges[-1])
        dev = self.staging.dev

        def view(i: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            t = dev[offsets[i][0]:offsets[i][1]]
            return t.view(shape) if shape is not None else t

        return StepInputs(
            input_ids=view(0), positions=view(1), slot_mapping=view(2), num_decode=num_decode,
            decode_lens=view(3) if num_decode else None,
            decode_block_tables=view(4, (num_decode, dec_width)) if num_decode else None,
            prefill_row_starts=view(5) if chunks else None, prefill_first_pos=view(6) if chunks else None,
            prefill_block_tables=view(7, (len(chunks), pre_width)) if chunks else None,
            keep=view(8) if keep is not None else None)


class DecodeStaticInputs:
    """Fixed-address inputs of decode-only steps of up to ``max_batch`` sequences with contexts of up to
    ``max_blocks`` blocks: what a CUDA graph captured over them reads at every replay."""

    def __init__(self, device: torch.device, block_size: int, max_batch: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.stride = w = -(-max_batch // ALIGN) * ALIGN  # each vector's room, 64-byte aligned
        self.staging = PinnedStaging(device, 4 * w + max_batch * max_blocks)
        b, dev = max_batch, self.staging.dev
        self.ids, self.positions, self.slots, self.lens = (dev[i * w:i * w + b] for i in range(4))
        self.tables = dev[4 * w:4 * w + b * max_blocks].view(b, max_blocks)
        for _ in range(2):  # both host buffers start as all padding (``fill`` alternates between them)
            self.staging.flip()
            self.staging.array[:] = 0
            self.staging.array[2 * w:3 * w] = NO_SLOT
        self.staging.upload(self.staging.array.shape[0])

    def inputs(self, batch: int) -> StepInputs:
        """Views for a graph of ``batch`` rows (captured once, replayed with whatever ``fill`` wrote)."""
        return StepInputs(self.ids[:batch], self.positions[:batch], self.slots[:batch], batch, self.lens[:batch],
                          self.tables[:batch], None, None, None, None)

    def fill(self, scheduled: list[ScheduledSeq], batch: int) -> None:
        """Write a decode-only plan into the first rows, padding up to ``batch`` rows, and send it."""
        bs, b, w = self.block_size, self.max_batch, self.stride
        self.staging.flip()  # the other host buffer: the step in flight may not have been copied from this one yet
        buf = self.staging.array
        ids, pos, slots, lens = (buf[i * w:i * w + b] for i in range(4))
        tables = buf[4 * w:4 * w + b * self.max_blocks].reshape(b, self.max_blocks)
        n = fill_decode_rows(scheduled, bs, ids, pos, slots, lens, tables)
        ids[n:batch] = 0
        pos[n:batch] = 0
        slots[n:batch] = NO_SLOT
        lens[n:batch] = 0
        # the vectors, then the table rows in use: one copy of a contiguous prefix of the buffer
        self.staging.upload(4 * w + batch * self.max_blocks)


def fill_decode_rows(scheduled: list[ScheduledSeq], block_size: int, ids: np.ndarray, pos: np.ndarray,
                     slots: np.ndarray, lens: np.ndarray, tables: np.ndarray) -> int:
    """One row per decoding sequence: its next input token, that token's position and KV slot, the context length
    it attends over and its block table. Returns how many rows it wrote."""
    for i, item in enumerate(scheduled):
        seq = item.seq
        p = seq.num_computed_tokens
        table = seq.block_table
        ids[i] = seq.token_ids[p]
        pos[i] = p
        slots[i] = table[p // block_size] * block_size + p % block_size
        lens[i] = p + 1
        tables[i, :len(table)] = table
    return len(scheduled)
