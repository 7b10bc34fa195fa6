"""Decode-step microbenchmark: one engine forward over B decoding sequences, A/B'd in one process.

Builds the engine's ModelRunner on the serving-benchmark model, fills the KV cache with noise, gives B
sequences random contexts (uniform in --ctx, blocks scattered over the cache like a busy engine's) and
times ``ModelRunner.execute`` (prepare + forward + logits) in four variants, alternated: "torch" (no
C++ kernels: bucketed gather + SDPA, F.rms_norm), "attn" (the paged decode kernel only), "all"
(plus the fused residual add + RMSNorm and the rotary kernel, the layers looped in Python) and "one-call"
(the same kernels, every layer in one ``llama_layers`` call); median of --iters per run, best of --runs.
1 thread unless --threads.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_step.py --batch 16 48 64
"""

from __future__ import annotations

import argparse
import random
import time

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

# before torch: the engine's OpenMP wait (GOMP_SPINCOUNT), which libgomp reads once, when torch loads it; the
# server imports the engine first, so in-process timings must too (without it, workers sleep after each region)
import serving.engine  # noqa: E402, F401

# isort: split
import torch  # noqa: E402

from benchmarks.bench_model import DEFAULT_MODEL_DIR, build_bench_model  # noqa: E402
from serving.engine.config import EngineConfig  # noqa: E402
from serving.engine.model_runner import ModelRunner  # noqa: E402
from serving.engine.sampling_params import SamplingParams  # noqa: E402
from serving.engine.scheduled_seq import ScheduledSeq  # noqa: E402
from serving.engine.sequence import Sequence  # noqa: E402


def decode_batch(runner: ModelRunner, batch: int, ctx: tuple[int, int], seed: int) -> list[ScheduledSeq]:
    rng = random.Random(seed)
    bs = runner.block_size
    free = list(range(1, runner.num_blocks))
    rng.shuffle(free)
    out = []
    for i in range(batch):
        n = rng.randint(*ctx)
        seq = Sequence(f"r{i}", [rng.randrange(7, runner.vocab_size) for _ in range(n)], SamplingParams(max_tokens=1))
        seq.block_table = [free.pop() for _ in range(-(-n // bs))]
        seq.num_computed_tokens = n - 1
        out.append(ScheduledSeq(seq, 1))
    return out


def median_ms(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--ctx", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        build_bench_model(DEFAULT_MODEL_DIR)
    runner = ModelRunner(DEFAULT_MODEL_DIR, EngineConfig(threads=args.threads))
    for c in runner.k_caches + runner.v_caches:
        c.normal_()
    kernels = runner.compact.kernels
    variants = {"torch": (None, None, False), "attn": (runner.decode_kernel, None, False),
                "all": (runner.decode_kernel, kernels, False), "one-call": (runner.decode_kernel, kernels, True)}
    if kernels is None:
        print("CPU kernels unavailable: timing the torch path only")
        variants = {"torch": (None, None, False)}
    for b in args.batch:
        sched = decode_batch(runner, b, tuple(args.ctx), seed=b)
        flags = [True] * b
        res: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.runs):
            for name, (attn, norm, one_call) in variants.items():
                runner.decode_kernel, runner.compact.kernels, runner.compact.fused_layers = attn, norm, one_call
                res[name].append(median_ms(lambda s=sched, f=flags: runner.execute(s, f), args.iters))
        print(f"B={b} ctx {args.ctx[0]}-{args.ctx[1]}: " + "  ".join(
            f"{n} {min(v):.1f} ms/step (runs {' '.join(f'{x:.1f}' for x in v)})" for n, v in res.items()))
    runner.decode_kernel, runner.compact.kernels, runner.compact.fused_layers = variants[list(variants)[-1]]


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
