"""Sustained memory read bandwidth, measured the way a decode step reads weights: one pass over a
buffer far larger than the caches. The batch-1 decode floor is weight bytes / this bandwidth.

Usage: python benchmarks/bandwidth.py [--gb 1.0] [--repeats 7] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import time


def measure_read_bandwidth(gb: float = 1.0, repeats: int = 7, threads: int | None = None) -> float:
    """Best-of-``repeats`` bytes/second for ``tensor.sum()`` over ``gb`` GB of fp32.

    Best-of, not mean: the machine is shared, and the floor should describe the hardware, not the
    neighbours. The buffer is filled first so the pages are resident.
    """
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        n = int(gb * 1e9) // 4
        x = torch.ones(n, dtype=torch.float32)
        x.sum()  # warm-up: fault pages in, spin up the thread pool
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        del x
        return n * 4 / best
    finally:
        torch.set_num_threads(old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    for t in args.threads:
        bw = measure_read_bandwidth(args.gb, args.repeats, t)
        print(f"threads={t}: {bw / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
