"""The fp32 projections of one decode step, per CPU GEMM: every projection of the bench model (8 layers' fused
QKV, O, gate/up and down, and the LM head) through ``DenseLinear`` with each backend that runs here, at several
activation row counts (1: a batch-1 decode; 16 and 64: batched decodes; 512: a prefill chunk).

Each projection cycles over enough copies of its weight that they do not fit in the last-level cache, so a row
count of 1 reads its weights from memory as a decode step does. Backends alternate within each round; the best
round counts (the host is shared). Prints ms per step, the weights' read rate at one row (GB/s), GFLOP/s, and each
backend's time over oneDNN's.

    .venv/bin/python benchmarks/cpu_gemm.py --threads 2 --rows 1 16 64 512
"""

from __future__ import annotations

import argparse
import time

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

# before torch: the engine's OpenMP wait (GOMP_SPINCOUNT), which libgomp reads once, when torch loads it; the
# server imports the engine first, so in-process timings must too (without it, workers sleep after each region)
import serving.engine  # noqa: E402, F401

# isort: split
import torch  # noqa: E402

from benchmarks.bench_model import BenchModelSpec  # noqa: E402
from serving.engine.compact_llama import DenseLinear  # noqa: E402
from serving.engine.linear_backend import choose_backend, mkl_packed_works, tiled_kernels  # noqa: E402


def projection_shapes(spec: BenchModelSpec) -> list[tuple[str, int, int, int]]:
    """(name, out features, in features, uses per step) of the bench model's fused projections."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * head_dim
    layers = spec.num_hidden_layers
    return [("qkv", qkv, spec.hidden_size, layers), ("o", spec.hidden_size, spec.hidden_size, layers),
            ("gate_up", 2 * spec.intermediate_size, spec.hidden_size, layers),
            ("down", spec.hidden_size, spec.intermediate_size, layers),
            ("lm_head", spec.vocab_size, spec.hidden_size, 1)]


def available_backends() -> list[str]:
    names = ["onednn"] if torch.backends.mkldnn.is_available() else []
    if tiled_kernels() is not None:
        names.append("tiled")
    if mkl_packed_works():
        names.append("mkl")
    return names or ["plain"]


def step_ms(layers: dict[str, list[DenseLinear]], uses: dict[str, int], x: dict[str, torch.Tensor],
            iters: int) -> float:
    """ms for one step's projections: each projection timed over ``iters`` calls cycling its copies."""
    total = 0.0
    for name, copies in layers.items():
        for i in range(3):
            copies[i % len(copies)](x[name])
        t0 = time.perf_counter()
        for i in range(iters):
            copies[i % len(copies)](x[name])
        total += (time.perf_counter() - t0) / iters * uses[name]
    return total * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-mb", type=float, default=96.0, help="bytes of copies per projection (beyond the LLC)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = BenchModelSpec()
    shapes = projection_shapes(spec)
    weight_bytes = sum(n * k * 4 * uses for _, n, k, uses in shapes)
    flops_per_row = sum(2 * n * k * uses for _, n, k, uses in shapes)
    backends = available_backends()
    g = torch.Generator().manual_seed(0)
    plain = {name: [torch.randn(n, k, generator=g) * 0.05
                    for _ in range(max(2, int(args.cache_mb * 1e6 // (n * k * 4)) + 1))] for name, n, k, _ in shapes}
    uses = {name: u for name, _, _, u in shapes}
    packed = {b: {name: [DenseLinear(w, None, b) for w in ws] for name, ws in plain.items()} for b in backends}
    print(f"{torch.get_num_threads()} thread(s); the engine's choice here: {choose_backend(plain['o'][0])}; "
          f"weights per step {weight_bytes / 1e6:.1f} MB")
    print("| rows | " + " | ".join(f"{b} ms/step" for b in backends) + " | " + " | ".join(
        f"{b} GB/s (1 row), GFLOP/s" for b in backends) + " | " +
        " | ".join(f"{b} / onednn" for b in backends if b != "onednn") + " |")
    print("|---:|" + "---:|" * (len(backends) * 2 + sum(b != "onednn" for b in backends)))
    for rows in args.rows:
        x = {name: torch.randn(rows, k, generator=g) for name, _, k, _ in shapes}
        iters = 60 if rows <= 64 else 8
        best = {b: float("inf") for b in backends}
        for _ in range(args.rounds):
            for b in backends:
                best[b] = min(best[b], step_ms(packed[b], uses, x, iters))
        rate = [f"{weight_bytes / best[b] / 1e6:.1f}" if rows == 1 else f"{flops_per_row * rows / best[b] / 1e6:.0f}"
                for b in backends]
        ratios = [f"{best[b] / best['onednn']:.2f}" for b in backends if b != "onednn" and "onednn" in best]
        print(f"| {rows} | " + " | ".join(f"{best[b]:.2f}" for b in backends) + " | " + " | ".join(rate) + " | " +
              " | ".join(ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
