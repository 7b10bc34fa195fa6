"""Prefill and verify attention, one layer: the ``paged_prefill`` kernel against the torch path it replaces.

Prefill chunks (a fresh prompt, a prompt continuing from cached blocks) and speculative verify chunks (a few
guessed tokens after a long context) run through ``attention.paged_attention`` twice, alternated: "torch"
(each chunk with SDPA; a chunk with cached context first gathers it from its blocks and builds an
offset-causal mask) and "kernel" (``cpu_kernels.paged_prefill``: every chunk in one call, straight from the
blocks). Both include writing the chunk's K/V into the cache. Shapes are the bench model's attention (8 query
heads, 2 KV heads, head dim 64, block size 16); median of --iters calls, best of --runs, and the largest
difference between the two outputs.

    .venv/bin/python benchmarks/prefill_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

import serving.engine  # noqa: E402,F401,I001 - before torch: its OpenMP defaults apply only then
import torch  # noqa: E402

from benchmarks.servers import machine_facts  # noqa: E402
from serving.engine import cpu_kernels  # noqa: E402
from serving.engine.attention import AttentionMetadata, PrefillChunk, paged_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16
# (what it is, [(cached tokens, chunk rows), ...]): one engine step's prefill or verify chunks
CASES = [
    ("verify: 5 tokens after 300", [(300, 5)]),
    ("verify: 16 sequences x 5 tokens after 100-400", [(100 + 20 * i, 5) for i in range(16)]),
    ("fresh prompt of 144", [(0, 144)]),
    ("fresh prompts 3 x 144 + 80", [(0, 144)] * 3 + [(0, 80)]),
    ("512-token chunk after 256 cached", [(256, 512)]),
]


def metadata(specs: list[tuple[int, int]], kc, vc, kernel) -> tuple[AttentionMetadata, int]:
    tables, slots, rows, block = [], [], [0], 1
    for start, n in specs:
        table = list(range(block, block + -(-(start + n) // BLOCK)))
        block += len(table)
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
        rows.append(rows[-1] + n)
    meta = AttentionMetadata([kc], [vc], torch.tensor(slots), num_decode=0, block_size=BLOCK)
    if kernel is not None:
        width = max(map(len, tables))
        meta.prefill_kernel = kernel
        meta.prefill_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        meta.prefill_row_starts = torch.tensor(rows)
        meta.prefill_first_pos = torch.tensor([start for start, _ in specs])
        return meta, rows[-1]
    for (start, n), table, r0 in zip(specs, tables, rows):
        if start == 0:
            meta.prefills.append(PrefillChunk(r0, r0 + n))
        else:
            mask = torch.arange(len(table) * BLOCK)[None, :] <= torch.arange(start, start + n)[:, None]
            meta.prefills.append(PrefillChunk(r0, r0 + n, torch.tensor(table), mask))
    return meta, rows[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.threads < 1 or args.iters < 1 or args.runs < 1:
        print("error: --threads, --iters and --runs must be at least 1", file=sys.stderr)
        return 2
    kernels = cpu_kernels.load()
    if kernels is None:
        print("error: the CPU kernels did not build here (no C++ compiler?); nothing to compare", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kc, vc = torch.randn(2048, BLOCK, KV_HEADS, HEAD_DIM), torch.randn(2048, BLOCK, KV_HEADS, HEAD_DIM)
    print(f"one attention layer ({HEADS} heads, {KV_HEADS} KV heads, head dim {HEAD_DIM}, block {BLOCK}), "
          f"{args.threads} thread(s); {machine_facts()}\n")
    print("| step's chunks | torch path | kernel | torch / kernel | max difference |")
    print("|---|---:|---:|---:|---:|")
    for name, specs in CASES:
        timings: dict[str, float] = {}
        outputs = {}
        rows = sum(n for _, n in specs)
        q, k, v = torch.randn(rows, HEADS, HEAD_DIM), torch.randn(rows, KV_HEADS, HEAD_DIM), \
            torch.randn(rows, KV_HEADS, HEAD_DIM)
        paths = {"torch": metadata(specs, kc, vc, None)[0], "kernel": metadata(specs, kc, vc, kernels.paged_prefill)[0]}
        for _ in range(args.runs):
            for label, meta in paths.items():
                for _ in range(5):
                    outputs[label] = paged_attention(q, k, v, 0, meta, None)
                samples = []
                for _ in range(args.iters):
                    start = time.perf_counter()
                    paged_attention(q, k, v, 0, meta, None)
                    samples.append(time.perf_counter() - start)
                timings[label] = min(timings.get(label, float("inf")), statistics.median(samples))
        diff = (outputs["torch"] - outputs["kernel"]).abs().max().item()
        print(f"| {name} | {timings['torch'] * 1e6:.0f} µs | {timings['kernel'] * 1e6:.0f} µs | "
              f"{timings['torch'] / timings['kernel']:.2f}× | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
