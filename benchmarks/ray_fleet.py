"""What Ray costs the fleet: replica start time, and latency through the gateway, the Ray backend against the
local one, on the same machine and model.

Two fleets (``serving.fleet.fleet.Fleet``, as `deploy` runs them): one on the local backend (a replica is a
`lifecycle serve` process on 127.0.0.1), one on the Ray backend (a replica is a Ray actor that starts the same
process where Ray places it) on a one-node Ray cluster started here with `ray start --head --block` (stopped
at the end; ``--ray-address`` uses yours instead). Then:

- replica start: ``--starts`` times per backend, alternated, a replica is started until /ready answers, and
  stopped; the median, and Ray's over local's;
- latency: each fleet serves one replica behind its own gateway, and the same streaming load
  (``--num-requests`` ``/v1/completions`` streams, ``--concurrency`` open at once, ignore_eos, greedy, fresh
  prompt tokens every run) runs against each gateway in ``--rounds`` rounds, the order alternated; TTFT p50
  and p95 and output tok/s, medians over rounds, and Ray's over local's;
- Ray's own processes (GCS, raylet, agents, the replica's actor worker; not the replica's server) as CPU
  seconds over the Ray runs and per idle minute: what the cluster takes from the cores the replicas share.

    .venv/bin/python benchmarks/ray_fleet.py

Replica logs go to a temporary folder (named when something fails); every process and actor started here is
stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from artifacts.common.stats import percentile  # noqa: E402
from benchmarks.servers import (  # noqa: E402
    bench_parser,
    build_model,
    check_model_dir,
    machine_facts,
    run_with_servers,
)
from benchmarks.stream_load import check_ranges, make_prompts, make_shapes, run_load, summarize  # noqa: E402

BACKENDS = ("local", "ray")
MODEL_NAME = "bench"  # the gateway's public model: what benchmarks.stream_load sends


def ray_cpu_seconds(cluster_pids: list[int]) -> float:
    """CPU seconds of every process of the cluster, leaving out the replicas' servers (and their engine cores)."""
    import psutil

    total = 0.0
    for pid in cluster_pids:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        servers = set()
        for proc in procs:
            try:
                if "serving.cli" in " ".join(proc.cmdline()):
                    servers |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            if proc.pid in servers:
                continue
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
    return total


def measure_starts(args: argparse.Namespace, fleets: dict, model: Path) -> dict[str, list[float]]:
    starts: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for i in range(args.starts):
        for backend in BACKENDS if i % 2 == 0 else BACKENDS[::-1]:
            t = time.perf_counter()
            replica = fleets[backend].start_replica(model, f"start{i}", timeout=args.startup_timeout)
            starts[backend].append(time.perf_counter() - t)
            fleets[backend].stop_replica(replica)
            print(f"  start {i + 1} {backend:<5} {starts[backend][-1]:5.1f} s", flush=True)
    return starts


async def measure_load(args: argparse.Namespace, gateways: dict[str, tuple[str, str]], vocab: int,
                       cluster_pids: list[int]) -> dict[str, list[dict[str, float]]]:
    import httpx

    shapes = make_shapes(args.num_requests, args.seed, tuple(args.prompt_range), tuple(args.output_range))
    runs: dict[str, list[dict[str, float]]] = {b: [] for b in BACKENDS}
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        warm = make_shapes(2, args.seed + 999, (16, 16), (8, 8))
        for url, key in gateways.values():
            await run_load(client, url, {"authorization": f"Bearer {key}"},
                           make_prompts(warm, vocab, args.seed + 998), warm, 2)
        for rnd in range(args.rounds):
            for i, backend in enumerate(BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]):
                url, key = gateways[backend]
                prompts = make_prompts(shapes, vocab, args.seed * 1000 + 2 * rnd + i)
                cpu0 = ray_cpu_seconds(cluster_pids)
                streams = await run_load(client, url, {"authorization": f"Bearer {key}"}, prompts, shapes,
                                         args.concurrency)
                res = summarize(streams, shapes)
                res["ttft_p95_ms"] = percentile([s.token_times[0] - s.sent for s in streams], 95) * 1e3
                res["ray_cpu_s"] = ray_cpu_seconds(cluster_pids) - cpu0
                runs[backend].append(res)
                print(f"  round {rnd + 1} {backend:<5} {res['output_tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{res['ttft_p50_ms']:7.1f} ms  p95 {res['ttft_p95_ms']:7.1f} ms", flush=True)
    return runs


def report(args: argparse.Namespace, starts: dict, runs: dict, idle: float | None, machine: str) -> str:
    med = {b: {"start": statistics.median(starts[b]),
               **{k: statistics.median(r[k] for r in runs[b]) for k in ("ttft_p50_ms", "ttft_p95_ms", "output_tok_s")}}
           for b in BACKENDS}
    lines = [f"### Ray backend against local ({args.num_requests} × `/v1/completions` stream through the fleet's "
             f"gateway, concurrency {args.concurrency}, prompt {args.prompt_range[0]}-{args.prompt_range[1]}, "
             f"output {args.output_range[0]}-{args.output_range[1]} tokens, ignore_eos, greedy, one replica with "
             f"--threads {args.threads}; medians: {args.starts} starts, {args.rounds} rounds)\n", f"{machine}\n",
             "| backend | replica start s | TTFT p50 ms | TTFT p95 ms | output tok/s |", "|---|---:|---:|---:|---:|"]
    for b in BACKENDS:
        m = med[b]
        lines.append(f"| {b} | {m['start']:.1f} | {m['ttft_p50_ms']:.1f} | {m['ttft_p95_ms']:.1f} | "
                     f"{m['output_tok_s']:.1f} |")
    ratio = {k: med["ray"][k] / med["local"][k] for k in med["ray"]}
    lines.append(f"| ray / local | {ratio['start']:.2f}× | {ratio['ttft_p50_ms']:.2f}× | {ratio['ttft_p95_ms']:.2f}× | "
                 f"{ratio['output_tok_s']:.2f}× |")
    lines.append(f"\nStarts (s): local {', '.join(f'{x:.1f}' for x in starts['local'])}; ray "
                 f"{', '.join(f'{x:.1f}' for x in starts['ray'])}.")
    wall = statistics.median(r["wall_s"] for r in runs["ray"])
    cpu = statistics.median(r["ray_cpu_s"] for r in runs["ray"])
    if idle is not None:
        lines.append(f"Ray's own processes: {cpu:.1f} CPU s over a {wall:.0f} s Ray run ({cpu / wall:.0%} of one "
                     f"core), {idle:.1f} CPU s per idle minute.")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = bench_parser("benchmarks/ray_fleet.py", __doc__)
    ap.add_argument("--ray-address", default=None, help="a running Ray cluster (default: start a one-node one here)")
    ap.add_argument("--ray-cpus", type=int, default=2, help="CPUs of the Ray node started here")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each replica (a Ray one reserves them)")
    ap.add_argument("--kv-memory", default="128MiB")
    ap.add_argument("--starts", type=int, default=3, help="replica starts per backend")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="streams open at once")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of local / ray")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-range", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--idle-seconds", type=float, default=20.0, help="how long Ray's idle CPU is measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a replica may take to be ready")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--keep-logs", action="store_true", help="keep the replicas' logs (kept anyway on failure)")
    args = ap.parse_args(argv)
    for name in ("threads", "starts", "num_requests", "concurrency", "rounds", "ray_cpus"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1")
    check_ranges(ap, args)
    check_model_dir(ap, args.model)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    return run_with_servers("ray-fleet-bench-", args.keep_logs, lambda children, logs: run(args, logs))


def run(args: argparse.Namespace, logs: Path) -> None:
    """Start the cluster (unless given) and both fleets, measure, print the report (and write ``--out``)."""
    import contextlib
    import os

    from tests.serving.ray_support import ray_cluster

    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    model = args.model.resolve() if args.model is not None else build_model(env)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with contextlib.ExitStack() as stack:
        if args.ray_address:
            address, cluster_pids = args.ray_address, []
        else:
            t = time.perf_counter()
            cluster = stack.enter_context(ray_cluster(head_cpus=args.ray_cpus, node_cpus=0))
            address, cluster_pids = cluster.address, cluster.pids
            print(f"Ray head at {address} in {time.perf_counter() - t:.0f} s", flush=True)
        fleets = {b: _fleet(args, logs / b, b, address) for b in BACKENDS}
        for fleet in fleets.values():
            stack.callback(fleet.stop_all)
        before = machine_facts()
        starts = measure_starts(args, fleets, model)
        gateways = {}
        for backend, fleet in fleets.items():
            replica = fleet.start_replica(model, "1", timeout=args.startup_timeout, warmup=2)
            gateways[backend] = (fleet.ensure_gateway(champion=replica), fleet.user_key())
        idle = None
        if cluster_pids:
            cpu0 = ray_cpu_seconds(cluster_pids)
            time.sleep(args.idle_seconds)
            idle = (ray_cpu_seconds(cluster_pids) - cpu0) * 60 / args.idle_seconds
        runs = asyncio.run(measure_load(args, gateways, vocab, cluster_pids))
    machine = (f"Machine: {before}; load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
               f"Ray {_ray_version()}.")
    text = report(args, starts, runs, idle, machine)
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                  "starts": starts, "runs": runs, "ray_idle_cpu_s_per_min": idle,
                                  "machine": machine, "markdown": text}
        args.out.write_text(json.dumps(result, indent=2))


def _fleet(args: argparse.Namespace, root: Path, backend: str, address: str):
    from serving.fleet.fleet import Fleet

    fleet = Fleet(root, MODEL_NAME, "", backend=backend, ray_address=address, threads=args.threads,
                  kv_memory=args.kv_memory)
    fleet.connect()
    return fleet


def _ray_version() -> str:
    import ray

    return ray.__version__


if __name__ == "__main__":
    sys.exit(main())
