"""Gateway cost: the same streaming load straight to an engine server, through the gateway, and through the
gateway with shadowing on, alternated in one run.

Starts, on 127.0.0.1 free ports, one engine server (``python -m serving.cli serve``; the champion), a second
one on the same model (the shadow variant) and the gateway (``python -m serving.gateway.cli``) in front of
both, each in its own process. One async httpx client then drives the same workload (``--num-requests``
``/v1/completions`` streams, ``ignore_eos``, greedy, at most ``--concurrency`` open at once) against:

- direct: the champion engine server itself;
- gateway: the gateway, shadow fraction 0 (an API key, rate limits, routing, SSE forwarding, observations);
- gateway + shadow: the same gateway with ``shadow_fraction`` 1.0 (set through its admin API), so every
  request is also mirrored (non-streaming) to the shadow server within the mirror budget
  (``shadow_mirror.max_concurrency``; mirrors over budget are dropped and counted).

The three run in ``--rounds`` rounds, the order rotated each round so the machine's noise falls on all of
them; each round uses fresh prompt tokens (same lengths) so the prefix cache cannot favour a later run.
Figures are as the client sees them: output tok/s (completion tokens / time to the last token), TTFT from
sending the request to the first streamed token, ITL between streamed token events. The table gives the
median over rounds; "× direct" and "+ ms" are medians of the per-round differences against direct. A
batch-1 section then alternates single requests direct / gateway and gives the added latency per request.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/gateway.py --threads 1

Everything the servers print goes to log files in a temporary folder (named when something fails); every
process started here is stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from artifacts.common.stats import percentile  # noqa: E402
from benchmarks.servers import (  # noqa: E402
    SERVED_NAME,
    BenchError,
    Child,
    bench_parser,
    build_model,
    check_model_dir,
    engine_server,
    free_port,
    machine_facts,
    run_with_servers,
    start_gateway,
    wait_ready,
)
from benchmarks.stream_load import (  # noqa: E402
    Shape,
    Stream,
    check_ranges,
    make_prompts,
    make_shapes,
    run_load,
    scrape,
    summarize,
)

CONFIGS = ("direct", "gateway", "gateway + shadow")
TARGET_LOSS = 0.10  # the targets at 16 concurrent streams
TARGET_TTFT_MS = 5.0


# ----------------------------------------------------------------------------- the gateway and the engines
async def wait_idle(client, engine_url: str, timeout_s: float = 300.0) -> None:
    """Until the engine has nothing running or waiting (the shadow's mirrors finish after the user's streams)."""
    deadline = time.monotonic() + timeout_s
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    while time.monotonic() < deadline:
        m = await scrape(client, engine_url, names)
        if sum(m.values()) == 0:
            return
        await asyncio.sleep(0.1)
    raise BenchError(f"{engine_url} still busy after {timeout_s:.0f} s")


async def set_shadow(client, gateway_url: str, admin: str, fraction: float) -> None:
    r = await client.put(gateway_url + "/admin/routing", json={"shadow_fraction": fraction},
                         headers={"authorization": f"Bearer {admin}"}, timeout=30)
    if r.status_code != 200 or r.json().get("shadow_fraction") != fraction:
        raise BenchError(f"PUT /admin/routing shadow_fraction={fraction}: HTTP {r.status_code} {r.text[:200]}")


SHADOW_METRICS = ("lifecycle_gateway_shadow_pairs_total", "lifecycle_gateway_shadow_dropped_total")


# ----------------------------------------------------------------------------- the run
@dataclass
class Fleet:
    direct: str
    shadow: str
    gateway: str
    user: str
    admin: str
    pids: dict[str, int]  # engine, shadow engine, gateway


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each server process so far (all its threads), and of this client."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    out["client"] = time.process_time()
    return out


async def bench(args: argparse.Namespace, fleet: Fleet, vocab: int) -> dict[str, Any]:
    import httpx

    shapes = make_shapes(args.num_requests, args.seed, tuple(args.prompt_range), tuple(args.output_range))
    limits = httpx.Limits(max_connections=args.concurrency + 16, max_keepalive_connections=args.concurrency + 16)
    user_headers = {"authorization": f"Bearer {fleet.user}"}
    targets = {"direct": (fleet.direct, {}), "gateway": (fleet.gateway, user_headers),
               "gateway + shadow": (fleet.gateway, user_headers)}
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
    mirrors: list[dict[str, float]] = []
    run_index = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        # warm-up: connections, both engines (the shadow one too), the gateway's first requests
        warm = make_shapes(2, args.seed + 999, (16, 16), (8, 8))
        for url, headers in ((fleet.direct, {}), (fleet.shadow, {}), (fleet.gateway, user_headers)):
            await run_load(client, url, headers, make_prompts(warm, vocab, args.seed + 998), warm, 2)
        await set_shadow(client, fleet.gateway, fleet.admin, 0.0)
        for rnd in range(args.rounds):
            order = CONFIGS[rnd % 3:] + CONFIGS[:rnd % 3]
            for name in order:
                run_index += 1
                prompts = make_prompts(shapes, vocab, args.seed * 1000 + run_index)
                url, headers = targets[name]
                shadow_on = name == "gateway + shadow"
                if shadow_on:
                    await set_shadow(client, fleet.gateway, fleet.admin, 1.0)
                    before = await scrape(client, fleet.gateway, SHADOW_METRICS)
                cpu0 = cpu_seconds(fleet.pids)
                try:
                    streams = await run_load(client, url, headers, prompts, shapes, args.concurrency)
                finally:
                    if shadow_on:
                        await set_shadow(client, fleet.gateway, fleet.admin, 0.0)
                res = summarize(streams, shapes)
                if shadow_on:
                    await wait_idle(client, fleet.shadow)
                cpu1 = cpu_seconds(fleet.pids)
                res.update({f"cpu_{k}_s": cpu1[k] - cpu0[k] for k in cpu0})
                if shadow_on:
                    await asyncio.sleep(0.3)  # the last pairs are compared and counted
                    after = await scrape(client, fleet.gateway, SHADOW_METRICS)
                    res["mirrored"] = after[SHADOW_METRICS[0]] - before[SHADOW_METRICS[0]]
                    res["mirror_dropped"] = after[SHADOW_METRICS[1]] - before[SHADOW_METRICS[1]]
                    mirrors.append(res)
                runs[name].append(res)
                extra = (f", mirrored {res['mirrored']:.0f}/{args.num_requests}" if shadow_on else "")
                print(f"  round {rnd + 1} {name:<17} {res['output_tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{res['ttft_p50_ms']:7.1f} ms  ITL p50 {res['itl_p50_ms']:6.1f} ms{extra}", flush=True)
                await wait_idle(client, fleet.direct)
        batch1 = await bench_batch1(args, client, fleet, vocab, user_headers)
    return {"runs": runs, "batch1": batch1}


async def bench_batch1(args: argparse.Namespace, client, fleet: Fleet, vocab: int,
                       user_headers: dict[str, str]) -> dict[str, Any]:
    """One request at a time, direct and through the gateway alternated request by request."""
    shape = [Shape(args.b1_prompt, args.b1_tokens)]
    per: dict[str, list[Stream]] = {"direct": [], "gateway": []}
    for i in range(args.b1_requests):
        pair = [("direct", fleet.direct, {}), ("gateway", fleet.gateway, user_headers)]
        for name, url, headers in pair if i % 2 == 0 else pair[::-1]:
            prompt = make_prompts(shape, vocab, args.seed * 7919 + 2 * i + (name == "gateway"))
            per[name].append((await run_load(client, url, headers, prompt, shape, 1))[0])
    out: dict[str, Any] = {}
    for name, streams in per.items():
        summarize(streams, shape * len(streams))  # checks the token counts
        ttft = [s.token_times[0] - s.sent for s in streams]
        e2e = [s.token_times[-1] - s.sent for s in streams]
        itl = [b - a for s in streams for a, b in zip(s.token_times, s.token_times[1:])]
        out[name] = {"ttft_p50_ms": percentile(ttft, 50) * 1e3, "e2e_p50_ms": percentile(e2e, 50) * 1e3,
                     "itl_p50_ms": percentile(itl, 50) * 1e3, "ttft": ttft, "e2e": e2e}
    out["added_ttft_ms"] = statistics.median(
        (g - d) * 1e3 for g, d in zip(out["gateway"]["ttft"], out["direct"]["ttft"]))
    out["added_e2e_ms"] = statistics.median(
        (g - d) * 1e3 for g, d in zip(out["gateway"]["e2e"], out["direct"]["e2e"]))
    return out


# ----------------------------------------------------------------------------- report
COLS = [("output_tok_s", "out tok/s", "{:.1f}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
        ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"), ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
        ("itl_p99_ms", "ITL p99 ms", "{:.1f}")]


def paired(runs: dict[str, list[dict]], name: str, base: str, key: str, ratio: bool) -> list[float]:
    """Per-round ratio (or difference) of ``name``'s figure against ``base``'s in the same round."""
    return [(a[key] / b[key]) if ratio else (a[key] - b[key]) for a, b in zip(runs[name], runs[base])]


def report(args: argparse.Namespace, res: dict[str, Any], machine: str) -> str:
    runs = res["runs"]
    med = {name: {k: statistics.median(r[k] for r in rs) for k, *_ in COLS} for name, rs in runs.items()}
    lines = [f"### Streaming load ({args.num_requests} × `/v1/completions` stream, concurrency {args.concurrency}, "
             f"prompt {args.prompt_range[0]}-{args.prompt_range[1]}, output {args.output_range[0]}-"
             f"{args.output_range[1]} tokens, ignore_eos, greedy; median of {args.rounds} rounds)\n",
             f"{machine}\n",
             "| path | " + " | ".join(c[1] for c in COLS) + " | × direct (tok/s) | + TTFT p50 ms | + ITL p50 ms |",
             "|---|" + "---:|" * (len(COLS) + 3)]
    for name in CONFIGS:
        cells = " | ".join(f.format(med[name][k]) for k, _, f in COLS)
        if name == "direct":
            lines.append(f"| {name} | {cells} | 1.00× | — | — |")
            continue
        ratio = statistics.median(paired(runs, name, "direct", "output_tok_s", True))
        dt = statistics.median(paired(runs, name, "direct", "ttft_p50_ms", False))
        di = statistics.median(paired(runs, name, "direct", "itl_p50_ms", False))
        lines.append(f"| {name} | {cells} | {ratio:.3f}× | {dt:+.1f} | {di:+.2f} |")
    lines += ["", f"CPU seconds per run of {args.num_requests} streams (median; the shadow engine's include finishing "
              "its mirrors):", "",
              "| path | wall s | engine | gateway | shadow engine | client | gateway µs per token |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name in CONFIGS:
        m = {k: statistics.median(r[k] for r in runs[name])
             for k in ("wall_s", "cpu_engine_s", "cpu_gateway_s", "cpu_shadow_s", "cpu_client_s", "tokens")}
        lines.append(f"| {name} | {m['wall_s']:.1f} | {m['cpu_engine_s']:.1f} | {m['cpu_gateway_s']:.2f} | "
                     f"{m['cpu_shadow_s']:.1f} | {m['cpu_client_s']:.2f} | "
                     f"{m['cpu_gateway_s'] / m['tokens'] * 1e6:.0f} |")
    per_round = ", ".join(f"{x:.3f}" for x in paired(runs, "gateway", "direct", "output_tok_s", True))
    per_ttft = ", ".join(f"{x:+.1f}" for x in paired(runs, "gateway", "direct", "ttft_p50_ms", False))
    lines.append(f"\nGateway vs direct per round: × tok/s {per_round}; + TTFT p50 ms {per_ttft}.")
    loss = 1 - statistics.median(paired(runs, "gateway", "direct", "output_tok_s", True))
    added = statistics.median(paired(runs, "gateway", "direct", "ttft_p50_ms", False))
    lines.append(f"Targets at {args.concurrency} streams: throughput loss {loss:.1%} (≤ {TARGET_LOSS:.0%}: "
                 f"{'met' if loss <= TARGET_LOSS else 'NOT met'}); added TTFT p50 {added:+.1f} ms "
                 f"(≤ {TARGET_TTFT_MS:.0f} ms: {'met' if added <= TARGET_TTFT_MS else 'NOT met'}).")
    sh = runs["gateway + shadow"]
    s_ratio = statistics.median(paired(runs, "gateway + shadow", "gateway", "output_tok_s", True))
    s_ttft = statistics.median(paired(runs, "gateway + shadow", "gateway", "ttft_p50_ms", False))
    s_itl = statistics.median(paired(runs, "gateway + shadow", "gateway", "itl_p50_ms", False))
    lines.append(f"Shadow cost (champion, shadow on vs off, same gateway): × {s_ratio:.3f} tok/s, TTFT p50 "
                 f"{s_ttft:+.1f} ms, ITL p50 {s_itl:+.2f} ms; mirrored "
                 f"{statistics.median(r['mirrored'] for r in sh):.0f} of {args.num_requests} per run, dropped "
                 f"{statistics.median(r['mirror_dropped'] for r in sh):.0f} (budget: "
                 f"{args.shadow_concurrency} mirrors in flight; the shadow server shares the machine).")
    b1 = res["batch1"]
    lines += [f"\n### Batch 1 ({args.b1_requests} requests each, prompt {args.b1_prompt}, {args.b1_tokens} tokens, "
              "direct and gateway alternated)\n",
              "| path | TTFT p50 ms | end-to-end p50 ms | ITL p50 ms |", "|---|---:|---:|---:|"]
    for name in ("direct", "gateway"):
        v = b1[name]
        lines.append(f"| {name} | {v['ttft_p50_ms']:.1f} | {v['e2e_p50_ms']:.1f} | {v['itl_p50_ms']:.2f} |")
    lines.append(f"\nAdded by the gateway per request (median of paired differences): TTFT {b1['added_ttft_ms']:+.1f} "
                 f"ms, end to end {b1['added_e2e_ms']:+.1f} ms.")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = bench_parser("benchmarks/gateway.py", __doc__)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine server")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="streams open at once")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of direct / gateway / gateway + shadow")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-range", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--shadow-concurrency", type=int, default=4, help="the gateway's shadow_mirror.max_concurrency")
    ap.add_argument("--b1-requests", type=int, default=16, help="batch-1 requests per path")
    ap.add_argument("--b1-prompt", type=int, default=32)
    ap.add_argument("--b1-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gateway-log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="the gateway's log_level (info logs a line per request, as deployed)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (kept anyway on failure)")
    args = ap.parse_args(argv)
    for name in ("threads", "num_requests", "concurrency", "rounds", "b1_requests", "b1_prompt", "b1_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.shadow_concurrency < 0:
        ap.error("--shadow-concurrency: must be >= 0")
    check_ranges(ap, args)
    check_model_dir(ap, args.model)
    return args


# ----------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    return run_with_servers("gateway-bench-", args.keep_logs, lambda children, logs: run(args, children, logs))


def run(args: argparse.Namespace, children: list[Child], logs: Path) -> None:
    """Start the servers into ``children``, measure, print the report (and write ``--out``)."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update({"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "TRANSFORMERS_VERBOSITY": "error"})
    env.pop("PYTHONPATH", None)
    model = args.model.resolve() if args.model is not None else build_model(env)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    fleet = start_fleet(args, model, children, logs, env)
    before = machine_facts()
    t = time.perf_counter()
    res = asyncio.run(bench(args, fleet, vocab))
    print(f"measured in {time.perf_counter() - t:.0f} s", flush=True)
    machine = f"Machine: {before}; load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}."
    text = report(args, res, machine)
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                 for k, v in vars(args).items()},
                                        "model": str(model), "machine": machine, **res, "markdown": text},
                                       indent=2, default=str))


def start_fleet(args: argparse.Namespace, model: Path, children: list[Child], logs: Path,
                env: dict[str, str]) -> Fleet:
    """The champion engine, a second engine on the same model (the shadow) and the gateway in front of both."""
    ports = {"direct": free_port(), "shadow": free_port(), "gateway": free_port()}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    t = time.perf_counter()
    champion = engine_server("engine", model, ports["direct"], args.threads, logs, env)
    children.append(champion)
    shadow = engine_server("shadow-engine", model, ports["shadow"], args.threads, logs, env)
    children.append(shadow)
    config = {"port": ports["gateway"], "model_name": SERVED_NAME, "state_dir": str(logs / "gateway-state"),
              "log_level": args.gateway_log_level,
              "champion": {"replicas": [urls["direct"]], "version": "1", "served_model": SERVED_NAME},
              "shadow": {"replicas": [urls["shadow"]], "version": "1-shadow", "served_model": SERVED_NAME},
              "shadow_mirror": {"fraction": 0.0, "max_concurrency": args.shadow_concurrency}}
    gateway, user, admin = start_gateway(config, logs, env)
    children.append(gateway)
    for child, url in ((champion, urls["direct"]), (shadow, urls["shadow"]), (gateway, urls["gateway"])):
        wait_ready(child, url, args.startup_timeout)
    print(f"servers ready in {time.perf_counter() - t:.0f} s: engine pid {champion.pid} {urls['direct']}, "
          f"shadow engine pid {shadow.pid} {urls['shadow']}, gateway pid {gateway.pid} {urls['gateway']}; "
          f"logs in {logs}", flush=True)
    return Fleet(urls["direct"], urls["shadow"], urls["gateway"], user, admin,
                 {"engine": champion.pid, "shadow": shadow.pid, "gateway": gateway.pid})


if __name__ == "__main__":
    sys.exit(main())
