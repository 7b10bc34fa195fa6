"""Gateway share bias: what a low-share variant pays through the gateway, against the same replicas
reached straight.

Starts on 127.0.0.1 three ``lifecycle serve`` replicas of one model (champion, canary, baseline; ``--threads``
each, ``OMP_WAIT_POLICY=PASSIVE`` and ``GOMP_SPINCOUNT=0`` as the local fleet starts them) and the gateway in
front of them (the local fleet's health settings), sets ``canary_weight`` (the baseline then takes the same share
from the top of the bucket range) through ``PUT /admin/routing``, and alternates two phases per round, each
bounded in time and in requests, with the same clients and users:

- direct: ``--clients`` closed-loop streaming clients, each request from one of ``--users`` users, sent straight
  to the replica that the gateway's own sticky split (``choose_variant``, same salt) gives that user;
- gateway: the same, through the gateway.

Per variant and path: requests, TTFT p50/p95 as the client saw it and, through the gateway, as the gateway
recorded it (``GET /admin/window``), the ratios canary/baseline and canary/champion (p95 over all rounds), and
the median of the client's TTFT minus the gateway's for the same request (the gateway's own front half).
The gateway runs with an aiohttp trace on its upstream session (added at its start, see
``benchmarks/gateway_trace.py``): per request, a new or a pooled connection, and when the upstream request
started, had its connection and got its response headers, on the client's clock; so the report splits the gateway's
TTFT into stages and counts the connections it opened to each replica. The replicas' own TTFT histograms
(scraped around each phase) split the mean TTFT into the engine's part and the rest; TTFT is also tabled by how
long the variant had been idle before the request, for both paths; and the report ends with the spread of an
A/A p95 ratio at a few sample sizes (bootstrap from this run's canary and baseline requests).

``--keep-alive canary=5`` starts that replica with another idle keep-alive than the server's own (an A/B of
``serving.api.server.KEEP_ALIVE_S`` within one run); ``--health-interval`` sets the gateway's /ready poll, which
also keeps a pooled connection in use; ``--paced G`` replaces the hashed share of canary and baseline by one
request about every G s each (a variant idle for a known time).

    .venv/bin/python benchmarks/gateway_share_bias.py --model bench
    .venv/bin/python benchmarks/gateway_share_bias.py --model DIR --keep-alive canary=5

Server output goes to log files in a temporary folder (named when something fails); every process started here
is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from artifacts.common.stats import percentile  # noqa: E402
from benchmarks.gateway_trace import read_trace  # noqa: E402
from benchmarks.servers import (  # noqa: E402
    SERVED_NAME,
    BenchError,
    Child,
    build_model,
    free_port,
    machine_facts,
    run_with_servers,
    serve_args,
    start_gateway,
    wait_ready,
)
from benchmarks.stream_load import FIRST_NORMAL_TOKEN, Stream, read_stream, scrape  # noqa: E402

VARIANTS = ("champion", "canary", "baseline")
PATHS = ("direct", "gateway")
ENGINE_TTFT = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")


# ----------------------------------------------------------------------------- workload
@dataclass
class Done:
    path: str
    variant: str
    request_id: str
    ttft_s: float | None
    idle_s: float  # since the variant's last request ended (0: one in flight; -1: its first in the phase)
    sent: float  # perf_counter (CLOCK_MONOTONIC: the gateway's trace uses the same clock)
    error: str | None = None


async def drive(client, targets: dict[str, str], headers: dict[str, str], variant_of: dict[str, str],
                args: argparse.Namespace, vocab: int, rng: random.Random, path: str, tag: str) -> list[Done]:
    """``--clients`` closed loops for ``--phase-seconds`` or ``--phase-requests``, whichever ends first.
    ``targets`` maps a variant to the URL its users are sent to (the gateway for all three, or each replica).
    With ``--paced G`` the loops draw only the champion's users, and each other variant gets one request at a
    time from its own users, about every G seconds (0.5-1.5 G apart): a variant idle for a known time."""
    done: list[Done] = []
    deadline = time.perf_counter() + args.phase_seconds
    sent = 0
    in_flight: dict[str, int] = defaultdict(int)
    last_end: dict[str, float] = {}
    users_of = {v: [u for u, x in variant_of.items() if x == v] for v in VARIANTS}
    loop_users = users_of["champion"] if args.paced else list(variant_of)

    async def one(user: str) -> None:
        nonlocal sent
        sent += 1
        variant = variant_of[user]
        n_prompt, n_out = rng.randint(*args.prompt_range), rng.randint(*args.output_range)
        body = {"model": SERVED_NAME, "prompt": [rng.randrange(FIRST_NORMAL_TOKEN, vocab) for _ in range(n_prompt)],
                "max_tokens": n_out, "temperature": 0, "ignore_eos": True, "stream": True, "user": user}
        request_id = f"{tag}-{sent}"
        out = Stream(sent=0.0)
        t0 = time.perf_counter()
        idle = 0.0 if in_flight[variant] else t0 - last_end[variant] if variant in last_end else -1.0
        in_flight[variant] += 1
        try:
            await read_stream(client, targets[variant], {**headers, "x-request-id": request_id}, body, out, t0)
            done.append(Done(path, variant, request_id, out.token_times[0] if out.token_times else None, idle, t0))
        except Exception as exc:  # noqa: BLE001 - counted and shown, the run goes on
            done.append(Done(path, variant, request_id, None, idle, t0, f"{type(exc).__name__}: {exc}"[:200]))
        finally:
            in_flight[variant] -= 1
            last_end[variant] = time.perf_counter()

    def going() -> bool:
        return time.perf_counter() < deadline and sent < args.phase_requests

    async def loop() -> None:
        while going():
            await one(rng.choice(loop_users))

    async def pacer(variant: str) -> None:
        await asyncio.sleep(rng.uniform(0, args.paced))
        while going():
            await one(rng.choice(users_of[variant]))
            await asyncio.sleep(args.paced * rng.uniform(0.5, 1.5))

    pacers = [pacer(v) for v in VARIANTS if v != "champion" and users_of[v]] if args.paced else []
    await asyncio.gather(*(loop() for _ in range(args.clients)), *pacers)
    return done


def gateway_ttfts(db: Path, prefix: str) -> dict[str, tuple[str, float | None, int, str | None]]:
    """request id -> (variant, TTFT ms, status, error) as the gateway stored them (the last attempt wins)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        rows = conn.execute("SELECT request_id, variant, ttft_ms, status, error FROM requests WHERE request_id LIKE ? "
                            "ORDER BY ts, rowid", (prefix + "-%",)).fetchall()
    return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}


async def bench(args: argparse.Namespace, urls: dict[str, str], gateway: str, user: str, admin: str, logs: Path,
                vocab: int) -> dict:
    import httpx

    from serving.gateway.routing import RoutingState, choose_variant

    admin_h = {"authorization": f"Bearer {admin}"}
    limits = httpx.Limits(max_connections=args.clients * 8, max_keepalive_connections=args.clients * 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits) as client:
        patch = {"canary_weight": args.canary_weight,
                 **{v: {"replicas": [urls[v]], "version": "1", "served_model": SERVED_NAME} for v in VARIANTS}}
        r = await client.put(gateway + "/admin/routing", json=patch, headers=admin_h)
        if r.status_code != 200:
            raise BenchError(f"PUT /admin/routing: HTTP {r.status_code} {r.text[:200]}")
        view = r.json()
        state = RoutingState.from_json({k: v for k, v in view.items() if k not in ("public_model", "replicas")})
        variant_of = {f"user-{i}": choose_variant(state, f"user-{i}") for i in range(args.users)}
        users = {v: sum(1 for x in variant_of.values() if x == v) for v in VARIANTS}
        print(f"routing generation {state.generation}: canary {state.canary_weight:g}%, baseline "
              f"{state.baseline_weight:g}%; users per variant {users}", flush=True)
        targets = {"direct": dict(urls), "gateway": dict.fromkeys(VARIANTS, gateway)}
        headers = {"direct": {}, "gateway": {"authorization": f"Bearer {user}"}}
        rng = random.Random(args.seed)
        warm = argparse.Namespace(**{**vars(args), "phase_seconds": 60, "phase_requests": 4, "clients": 1,
                                        "paced": None})
        for v in VARIANTS:  # each replica's first-use costs, straight (the gateway records nothing)
            await drive(client, targets["direct"], {}, dict.fromkeys(variant_of, v), warm, vocab, rng, "direct",
                        f"warm-{v}")
        rows: list[dict] = []
        opened = dict.fromkeys(VARIANTS, 0)
        engine = {(p, v): {"sum": 0.0, "count": 0.0} for p in PATHS for v in VARIANTS}
        for rnd in range(args.rounds):
            for path in (PATHS if rnd % 2 == 0 else PATHS[::-1]):
                tag = f"r{rnd}-{path}"
                await asyncio.sleep(args.settle)
                since = time.time()
                _, before = read_trace(logs / "upstream-trace.jsonl")
                engine0 = {v: await scrape(client, urls[v], ENGINE_TTFT) for v in VARIANTS}
                done = await drive(client, targets[path], headers[path], variant_of, args, vocab, rng, path, tag)
                for v in VARIANTS:  # the replica's own TTFT (engine arrival to first token), summed over the phase
                    engine1 = await scrape(client, urls[v], ENGINE_TTFT)
                    for name, key in zip(ENGINE_TTFT, ("sum", "count")):
                        engine[(path, v)][key] += engine1[name] - engine0[v][name]
                counts = {v: sum(1 for d in done if d.variant == v) for v in VARIANTS}
                line = f"  round {rnd + 1} {path:<7} {len(done):4d} requests " + " ".join(
                    f"{v} {counts[v]}" for v in VARIANTS)
                new_rows = [{"round": rnd, "path": path, "variant": d.variant, "ttft_ms": _ms(d.ttft_s),
                             "idle_s": d.idle_s, "error": d.error} for d in done]
                if path == "gateway":
                    await asyncio.sleep(0.3)
                    w = (await client.get(gateway + "/admin/window", params={"since": since},
                                          headers=admin_h)).json()
                    stored = gateway_ttfts(logs / "gateway-state" / "observations.db", tag)
                    posts, after = read_trace(logs / "upstream-trace.jsonl")
                    for d, row in zip(done, new_rows):
                        g, t = stored.get(d.request_id), posts.get(d.request_id)
                        row["gw_ttft_ms"] = g[1] if g else None
                        row["gw_error"] = g[3] if g else None
                        if t and t.get("t_headers"):  # stages on the client's clock (CLOCK_MONOTONIC)
                            row |= {"conn": t["conn"], "to_upstream_ms": (t["t0"] - d.sent) * 1e3,
                                    "conn_ms": (t["t_conn"] - t["t0"]) * 1e3,
                                    "headers_ms": (t["t_headers"] - t["t0"]) * 1e3}
                    phase_opened = {v: after.get(urls[v], 0) - before.get(urls[v], 0) for v in VARIANTS}
                    for v in VARIANTS:
                        opened[v] += phase_opened[v]
                    fails = {x["variant"]: x["status_5xx"] + x["fallbacks"] for x in w["variants"]}
                    line += ("; connections opened " + " ".join(f"{v} {phase_opened[v]}" for v in VARIANTS)
                             + "; gateway 5xx+fallbacks " + " ".join(f"{v} {fails.get(v, 0)}" for v in VARIANTS)
                             + "; gateway TTFT p95 " + " ".join(
                                 f"{x['variant']} {percentile(x['ttft_ms'], 95):.0f}" for x in w["variants"]))
                rows += new_rows
                print(line, flush=True)
    return {"rows": rows, "opened": opened, "users": users,
            "engine_ttft_ms": {f"{p} {v}": e["sum"] / e["count"] * 1e3 if e["count"] else None
                               for (p, v), e in engine.items()}}


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


# ----------------------------------------------------------------------------- report
IDLE_BINS = ((0.0, 0.0, "busy (one in flight)"), (0.0, 0.5, "idle < 0.5 s"), (0.5, 2.0, "idle 0.5-2 s"),
             (2.0, 1e9, "idle ≥ 2 s"))


def report(args: argparse.Namespace, res: dict, machine: str) -> str:
    rows = res["rows"]

    def pick(path: str, variants: tuple[str, ...], key: str = "ttft_ms", **where) -> list[float]:
        return [r[key] for r in rows if r["path"] == path and r["variant"] in variants and not r["error"]
                and r.get(key) is not None and all(r.get(k) == v for k, v in where.items())]

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.1f}" if xs else "—"

    keep_alive = ", ".join([f"{v} {s:g} s" for v, s in args.keep_alive.items()] + ["the server's own"])
    lines = [f"### {args.label}\n", f"{machine}\n",
             f"{args.clients} closed-loop streaming clients, {args.users} users (per variant {res['users']}), canary "
             f"{args.canary_weight:g}% / baseline {args.canary_weight:g}%"
             + (f" (paced: canary and baseline one request each about every {args.paced:g} s, the loops carry only "
                f"the champion's users)" if args.paced else "") + f", {args.rounds} rounds of "
             f"{args.phase_seconds:g} s per path, prompt {args.prompt_range[0]}-{args.prompt_range[1]}, output "
             f"{args.output_range[0]}-{args.output_range[1]} tokens, `--threads {args.threads}`, the gateway's /ready "
             f"poll every {args.health_interval:g} s, replicas' idle keep-alive: {keep_alive}.\n",
             "| path | variant | requests | errors | TTFT p50 ms | TTFT p95 ms | gateway's TTFT p50 | gateway's p95 | "
             "client − gateway p50 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    p95: dict[tuple[str, str], float] = {}
    for path in PATHS:
        for v in VARIANTS:
            xs = pick(path, (v,))
            n = sum(1 for r in rows if r["path"] == path and r["variant"] == v)
            errors = sum(1 for r in rows if r["path"] == path and r["variant"] == v and r["error"])
            p95[(path, v)] = percentile(xs, 95)
            gw = pick(path, (v,), "gw_ttft_ms")
            front = [r["ttft_ms"] - r["gw_ttft_ms"] for r in rows if r["path"] == path and r["variant"] == v
                     and r.get("gw_ttft_ms") is not None and r["ttft_ms"] is not None]
            cells = f"{percentile(gw, 50):.1f} | {percentile(gw, 95):.1f} | {med(front)}" if gw else "— | — | —"
            lines.append(f"| {path} | {v} | {n} | {errors} | {percentile(xs, 50):.1f} | {p95[(path, v)]:.1f} | "
                         f"{cells} |")
    lines += ["", "| path | TTFT p95 canary/baseline | canary/champion | baseline/champion | "
              "canary/baseline per round |", "|---|---:|---:|---:|---|"]
    for path in PATHS:
        per_round = []
        for rnd in range(args.rounds):
            a, b = pick(path, ("canary",), round=rnd), pick(path, ("baseline",), round=rnd)
            per_round.append(f"{percentile(a, 95) / percentile(b, 95):.2f}" if a and b else "—")
        lines.append(f"| {path} | {p95[(path, 'canary')] / p95[(path, 'baseline')]:.2f}× | "
                     f"{p95[(path, 'canary')] / p95[(path, 'champion')]:.2f}× | "
                     f"{p95[(path, 'baseline')] / p95[(path, 'champion')]:.2f}× | {', '.join(per_round)} |")
    lines += ["", "Mean TTFT (ms) split: the replica's engine (its own histogram: arrival in the engine to the first "
              "token) and the rest (the replica's HTTP side, the pipe, and on the gateway path the gateway):", "",
              "| path | variant | client mean | replica engine mean | rest |", "|---|---|---:|---:|---:|"]
    for path in PATHS:
        for v in VARIANTS:
            xs, eng = pick(path, (v,)), res["engine_ttft_ms"][f"{path} {v}"]
            if xs and eng is not None:
                mean = statistics.fmean(xs)
                lines.append(f"| {path} | {v} | {mean:.1f} | {eng:.1f} | {mean - eng:.1f} |")
    lines += ["", "Through the gateway, its upstream stages (medians, ms, on one clock: the client's send, the "
              "gateway's upstream request start, a connection in hand, the replica's response headers):", "",
              "| variant | requests | on a new connection | their TTFT p50 | send → upstream start | "
              "start → connection | start → response headers | gateway's TTFT p50 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for v in VARIANTS:
        traced = [r for r in rows if r["path"] == "gateway" and r["variant"] == v and r.get("conn")]
        new = [r["ttft_ms"] for r in traced if r["conn"] == "new" and r["ttft_ms"] is not None]
        lines.append(f"| {v} | {len(traced)} | {len(new)} | {med(new)} | "
                     f"{med([r['to_upstream_ms'] for r in traced])} | {med([r['conn_ms'] for r in traced])} | "
                     f"{med([r['headers_ms'] for r in traced])} | {med(pick('gateway', (v,), 'gw_ttft_ms'))} |")
    low = ("canary", "baseline")
    lines += ["", "TTFT of canary + baseline requests by how long their variant had been idle before (p50 / p95 ms, "
              "requests):", "", "| path | " + " | ".join(b[2] for b in IDLE_BINS) + " |",
              "|---|" + "---:|" * len(IDLE_BINS)]
    for path in PATHS:
        cells = []
        for lo, hi, _ in IDLE_BINS:
            xs = [r["ttft_ms"] for r in rows if r["path"] == path and r["variant"] in low and not r["error"]
                  and r["ttft_ms"] is not None and ((r["idle_s"] == 0) if hi == 0 else lo < r["idle_s"] <= hi)]
            cells.append(f"{percentile(xs, 50):.0f} / {percentile(xs, 95):.0f} ({len(xs)})" if xs else "—")
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    reqs = {v: sum(1 for r in rows if r["path"] == "gateway" and r["variant"] == v) for v in VARIANTS}
    lines.append("\nConnections the gateway opened to each replica during its phases (its /ready polls included): "
                 + ", ".join(f"{v} {res['opened'][v]} for {reqs[v]} requests" for v in VARIANTS) + ".")
    rng = random.Random(0)
    spread = []
    for path in PATHS:  # A/A by construction: both samples from one pool of low-share TTFTs
        pool = pick(path, low)
        for n in (20, 50, 100):
            if len(pool) >= n:
                ratios = sorted(percentile(rng.choices(pool, k=n), 95) / percentile(rng.choices(pool, k=n), 95)
                                for _ in range(2000))
                spread.append(f"{path} n={n}: {percentile(ratios, 5):.2f}-{percentile(ratios, 95):.2f}×")
    lines.append("\nSpread of an A/A TTFT p95 ratio (two samples of n requests drawn from this run's canary + baseline "
                 "TTFTs, 2,000 draws, 5th-95th percentile): " + "; ".join(spread) + ".")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def replica_server(variant: str, model: Path, port: int, args: argparse.Namespace, logs: Path,
                   env: dict[str, str]) -> Child:
    """``lifecycle serve`` with the gateway benchmark's flags; with ``--keep-alive VARIANT=S``, with the server's
    idle keep-alive (``serving.api.server.KEEP_ALIVE_S``) set to S seconds for that replica."""
    serve = serve_args(model, port, args.threads)
    if variant not in args.keep_alive:
        return Child(variant, [sys.executable, "-m", "serving.cli", *serve], logs / f"{variant}.log", env)
    code = ("import sys, serving.api.server as s; s.KEEP_ALIVE_S = float(sys.argv[1]); "
            "from serving.cli import main; sys.exit(main(sys.argv[2:]))")
    return Child(variant, [sys.executable, "-c", code, str(args.keep_alive[variant]), *serve],
                 logs / f"{variant}.log", env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/gateway_share_bias.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="bench", help="'bench' (the 32M bench Llama) or a Hugging Face model dir")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each replica")
    ap.add_argument("--clients", type=int, default=6, help="closed-loop streaming clients")
    ap.add_argument("--users", type=int, default=600, help="distinct users (the sticky split's keys)")
    ap.add_argument("--canary-weight", type=float, default=5.0, help="percent; the baseline gets as much")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of direct / gateway (order alternates)")
    ap.add_argument("--phase-seconds", type=float, default=15.0, help="length of one path's phase")
    ap.add_argument("--phase-requests", type=int, default=3000, help="at most this many requests per phase")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet before each phase")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"))
    ap.add_argument("--output-range", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"))
    ap.add_argument("--health-interval", type=float, default=0.5,
                    help="the gateway's /ready poll interval (the local fleet's 0.5 s; each poll also keeps a pooled "
                         "connection to the replica in use)")
    ap.add_argument("--paced", type=float, default=None, metavar="G",
                    help="instead of the hashed share, send canary and baseline one request about every G s each "
                         "(the closed loops then carry only the champion's users)")
    ap.add_argument("--label", default="Gateway share bias", help="the report's heading")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None, help="also write every request as JSON here")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--keep-alive", action="append", default=[], metavar="VARIANT=SECONDS",
                    help="start that replica with this idle keep-alive instead of the server's own (repeatable)")
    args = ap.parse_args(argv)
    try:
        args.keep_alive = {v: float(s) for v, s in (item.split("=", 1) for item in args.keep_alive)}
    except ValueError:
        ap.error("--keep-alive: want VARIANT=SECONDS, e.g. canary=5")
    if set(args.keep_alive) - set(VARIANTS):
        ap.error(f"--keep-alive: variants are {', '.join(VARIANTS)}")
    for name in ("threads", "clients", "users", "rounds", "phase_requests"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1")
    if not 0 < args.canary_weight <= 50:
        ap.error("--canary-weight: must be in (0, 50]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_with_servers("gateway-share-bias-", args.keep_logs, lambda children, logs: run(args, children, logs))


def run(args: argparse.Namespace, children: list[Child], logs: Path) -> None:
    """Start the replicas and the traced gateway into ``children``, measure, print the report (and ``--out``)."""
    env = dict(os.environ) | {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0",  # as the local backend's spawn
                              "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                              "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("PYTHONPATH", None)
    model = build_model(env) if args.model == "bench" else Path(args.model).resolve()
    if not (model / "config.json").is_file():
        raise BenchError(f"--model: {model} is not a Hugging Face model dir (no config.json)")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ports = {v: free_port() for v in (*VARIANTS, "gateway")}
    urls = {v: f"http://127.0.0.1:{ports[v]}" for v in VARIANTS}
    for v in VARIANTS:
        children.append(replica_server(v, model, ports[v], args, logs, env))
    config = {"host": "127.0.0.1", "port": ports["gateway"], "model_name": SERVED_NAME,
              "state_dir": str(logs / "gateway-state"),
              "health": {"interval_s": args.health_interval, "eject_after": 2},  # the fleet's: 0.5 s
              "champion": {"replicas": [urls["champion"]], "version": "1", "served_model": SERVED_NAME}}
    code = ("import sys; from benchmarks.gateway_trace import run_traced_gateway; "
            "sys.exit(run_traced_gateway(sys.argv[1], sys.argv[2]))")
    gw, user, admin = start_gateway(config, logs, env, launcher=[sys.executable, "-c", code],
                                    extra=(str(logs / "upstream-trace.jsonl"),))
    children.append(gw)
    gateway = f"http://127.0.0.1:{ports['gateway']}"
    for child, url in zip(children, [*urls.values(), gateway]):
        wait_ready(child, url, args.startup_timeout, "/ready" if child is not gw else "/health")
    print(f"servers ready; logs in {logs}", flush=True)
    before = machine_facts()
    res = asyncio.run(bench(args, urls, gateway, user, admin, logs, vocab))
    machine = f"Machine: {before}; load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}."
    text = report(args, res, machine)
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **res,
                                        "markdown": text}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
