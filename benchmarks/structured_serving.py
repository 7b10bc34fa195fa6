"""Constrained decoding through HTTP: is every finished reply valid, and what does the grammar cost?

Starts `lifecycle serve` on the random-init bench model (the worst writer of JSON there is) and sends, at
``--concurrency`` streams, one chat request per random schema (``benchmarks/random_schemas.py``) with
``response_format: json_schema``. Then:

- **validity**: of the replies that finished (``stop``), how many parse and validate; how many ``max_tokens`` cut;
- **cost**: the same prompts unconstrained, each asked for exactly the tokens its constrained reply had
  (``ignore_eos``), so both runs decode the same number of tokens: output tokens/s, side by side;
- **a new schema's first token**: TTFT of a schema's first request (compiled then) against its second (cached).

    .venv/bin/python benchmarks/structured_serving.py [--schemas 500] [--concurrency 16] [--threads 2]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.random_schemas import random_schemas  # noqa: E402
from benchmarks.servers import (  # noqa: E402
    SERVED_NAME,
    bench_parser,
    build_model,
    check_model_dir,
    free_port,
    launch,
    machine_facts,
    run_with_servers,
    serve_args,
)

PROMPT = "Reply with one JSON object."


@dataclass
class Reply:
    finish_reason: str
    text: str
    tokens: int
    ttft_s: float


async def _chat(client, base: str, body: dict) -> Reply:
    """One streamed chat request: its text, finish reason, completion tokens and time to first token."""
    started = time.perf_counter()
    ttft, parts, reason, tokens = None, [], "?", 0
    body = {**body, "model": SERVED_NAME, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": PROMPT}]}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - started
                    parts.append(choice["delta"]["content"])
                reason = choice.get("finish_reason") or reason
    return Reply(reason, "".join(parts), tokens, ttft or time.perf_counter() - started)


async def _run_all(base: str, bodies: list[dict], concurrency: int) -> tuple[list[Reply], float]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def one(body: dict) -> Reply:
            async with gate:
                return await _chat(client, base, body)

        started = time.perf_counter()
        replies = await asyncio.gather(*(one(b) for b in bodies))
    return list(replies), time.perf_counter() - started


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def _validity(schemas: list[dict], replies: list[Reply]) -> tuple[int, int, int, list[str]]:
    from jsonschema import Draft202012Validator

    finished = valid = cut = 0
    problems = []
    for schema, reply in zip(schemas, replies):
        if reply.finish_reason == "length":
            cut += 1
        if reply.finish_reason != "stop":
            continue
        finished += 1
        try:
            Draft202012Validator(schema).validate(json.loads(reply.text))
            valid += 1
        except Exception as exc:  # noqa: BLE001 - every failure is a finding to print
            problems.append(f"{type(exc).__name__}: {str(exc)[:80]} in {reply.text[:80]!r}")
    return finished, valid, cut, problems


def measure(base: str, args) -> str:
    schemas = random_schemas(args.schemas, args.seed)
    constrained = [{"max_tokens": args.max_tokens, "temperature": 1.0, "seed": i, "response_format": _format(s)}
                   for i, s in enumerate(schemas)]
    asyncio.run(_run_all(base, constrained[:args.concurrency], args.concurrency))  # warm-up: compile paths, caches
    replies, wall = asyncio.run(_run_all(base, constrained, args.concurrency))
    finished, valid, cut, problems = _validity(schemas, replies)
    free = [{"max_tokens": max(r.tokens, 1), "min_tokens": max(r.tokens, 1), "ignore_eos": True,
             "temperature": 1.0, "seed": i} for i, r in enumerate(replies)]
    free_replies, free_wall = asyncio.run(_run_all(base, free, args.concurrency))
    tokens, free_tokens = sum(r.tokens for r in replies), sum(r.tokens for r in free_replies)
    fresh = random_schemas(args.new_schemas, args.seed + 1000)
    first, second = [], []
    for i, schema in enumerate(fresh):  # one at a time: the compile is the only difference
        body = {"max_tokens": 8, "temperature": 0.0, "seed": i, "response_format": _format(schema)}
        first.append(asyncio.run(_run_all(base, [body], 1))[0][0].ttft_s)
        second.append(asyncio.run(_run_all(base, [body], 1))[0][0].ttft_s)
    lines = [
        f"{args.schemas} random schemas (seed {args.seed}), {args.concurrency} streams, max_tokens {args.max_tokens}, "
        f"temperature 1.0; bench model, `lifecycle serve --threads {args.threads}`; {machine_facts()}",
        "",
        "| run | replies | finished (stop) | valid of finished | cut by max_tokens | output tokens | tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| json_schema | {len(replies)} | {finished} | {valid}/{finished} | {cut} | {tokens} | {tokens / wall:.0f} |",
        f"| unconstrained, same lengths | {len(free_replies)} | | | | {free_tokens} | {free_tokens / free_wall:.0f} |",
        "",
        f"constrained / unconstrained tokens/s: {(tokens / wall) / (free_tokens / free_wall):.2f}×",
        f"TTFT, a schema's first request (compiled) p50 {statistics.median(first) * 1e3:.1f} ms, its second "
        f"(cached) p50 {statistics.median(second) * 1e3:.1f} ms, over {len(fresh)} new schemas, one at a time",
    ]
    lines += [f"invalid: {p}" for p in problems[:5]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("structured_serving.py", __doc__)
    ap.add_argument("--schemas", type=int, default=500)
    ap.add_argument("--new-schemas", type=int, default=20, help="schemas for the first-token comparison")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    check_model_dir(ap, args.model)

    def body(children, logs: Path) -> None:
        import os

        env = dict(os.environ)
        model = args.model or build_model(env)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        launch(children, "ours", [sys.executable, "-m", "serving.cli", *serve_args(model, port, args.threads)],
               logs / "ours.log", env, base, timeout_s=300)
        print(measure(base, args), flush=True)

    return run_with_servers("structured-serving-", args.keep_logs, body)


if __name__ == "__main__":
    sys.exit(main())
