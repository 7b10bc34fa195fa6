"""Where the engine's time goes under many streams: cProfile of one in-process workload, top functions.

The HTTP benchmark (``benchmarks/http_serving.py``) says how fast; this says why. It runs the HTTP
benchmark's workload shape (``--requests`` requests at once, prompts 32-256 random tokens, 16-256 output
tokens with ``ignore_eos``, greedy) through ``LLMEngine.step`` in this process, once to warm up (kernel
build, allocator) and once under cProfile, then prints output tokens/s and the functions that took the most
time of their own. Torch ops and our C++ kernels show up by name (``_linear_pointwise``, ``paged_decode``).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/engine_profile.py --model bench --threads 2
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.servers import build_model, machine_facts  # noqa: E402


def add_workload(engine, requests: int, vocab: int, rng: random.Random) -> None:
    from serving.engine import SamplingParams

    for i in range(requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(32, 257))]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(16, 257), ignore_eos=True)
        engine.add_request(f"profile-{i}-{time.monotonic_ns()}", prompt, params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench", help="'bench' (the 32M bench Llama) or a model directory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--top", type=int, default=15, help="functions to list")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from artifacts.errors import LifecycleError
    from serving.engine import EngineConfig, LLMEngine

    model = build_model(dict(os.environ)) if args.model == "bench" else Path(args.model)
    try:
        config = EngineConfig(threads=args.threads, max_queue=max(256, args.requests))
        engine = LLMEngine.from_pretrained(model, config)
    except (LifecycleError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    vocab, rng = engine.runner.vocab_size, random.Random(args.seed)
    add_workload(engine, args.requests, vocab, rng)
    while engine.has_unfinished():
        engine.step()
    add_workload(engine, args.requests, vocab, rng)
    tokens_before, steps_before = engine.generation_tokens_total, engine.num_steps
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    while engine.has_unfinished():
        engine.step()
    profile.disable()
    took = time.perf_counter() - start
    tokens = engine.generation_tokens_total - tokens_before
    print(f"model `{model}`, {args.threads} thread(s), {args.requests} requests at once; {machine_facts()}")
    print(f"{tokens} output tokens in {took:.2f} s under the profiler: {tokens / took:.0f} tok/s, "
          f"{engine.num_steps - steps_before} steps\n")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
