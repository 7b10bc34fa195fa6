"""The engine on a GPU, measured in one device call: facts, our engine against HF `generate`, HTTP, 4-bit, launches.

The GPU machine is lent for minutes at a time and starts bare (issue 34), so this runs every measurement of the
device check in one process, under a time budget, and rewrites its JSON (``--out``/gpu_serving.json, a temporary
file then a rename) after every row: a run cut short by the device's timeout still returns everything it measured.
Every section runs in its own try/except and records its error; a section the remaining budget cannot pay for is
skipped with the reason written down. Sections, in priority order (the engine's first variant, ``ours``, runs
before the HF baselines, HTTP and 4-bit; its other variants run last):

1. ``facts``: the device, the library versions, and the measured device-to-device copy bandwidth (bytes read plus
   written, median of repeats timed with CUDA events); with the model's weight bytes it gives the HBM floor, the
   ms per decode step that streaming the weights once costs.
2. ``model``: a random-init Llama-3-shaped model (``--shape 1b``: hidden 2048, 16 layers, 32/8 heads, intermediate
   8192, vocab 32000, untied head; ``tiny`` for CPU) initialised on the device and saved as a HF dir under
   ``--work`` (never under ``--out``: that comes back over the wire). It has no tokenizer: the engine, HF and the
   4-bit runs take token ids, so no run pays detokenisation the others do not. The HTTP run serves a sibling dir
   that adds a word-level tokenizer of the full vocabulary, so the server detokenises as it would in production.
3. ``engine``: ``LLMEngine`` in-process per variant (``ours`` = defaults, async scheduling on;
   ``ours-sync`` = one step at a time, batches 1 and 64; ``ours-eager`` = no CUDA graphs,
   ``ours-torch`` = torch attention and no graphs, roughly the path before issue 34) at each batch size: seeded
   token-id prompts of mixed lengths, ``max_tokens`` fixed, ``ignore_eos``, greedy, after a short warm-up run at the
   same batch. Decode tok/s counts the tokens made after the last sequence got its first one, over that time; total
   tok/s is every output token over the whole run (prefill included), as a user sees it.
4. ``hf``: HF ``generate`` on the same prompts, left-padded: eager (DynamicCache), and with a static cache, which
   transformers compiles by itself on a GPU (``torch.compile`` mode reduce-overhead: CUDA graphs); its first call
   at a batch size pays the compile, timed apart, and the row is the fastest of up to three more calls (it stops
   once two agree within 15 %: a second call may still be recording graphs). On CPU the static cache runs
   uncompiled unless ``--hf-compile`` (about 90 s per batch size for the tiny model on 2 cores). Batches run in the
   order 64, 256, 1, 16 so a short budget keeps the ones the goals compare. Ratios ours / HF per batch are in
   ``summary``.
5. ``http``: ``python -m serving.cli serve`` (engine process) with 64 concurrent ``/v1/completions`` streams through
   ``benchmarks.stream_load``: TTFT and inter-token latency p50/p95, output tok/s; the server's own mean TTFT (its
   ``vllm:time_to_first_token_seconds``: request handed to the engine core to first token sampled) beside the
   client's, and the TTFT of 64 one-token requests arriving together (admission and prefill, no streams to keep
   up with). The server is stopped in a ``finally`` (SIGTERM included).
6. ``gptq``: the RTN 4-bit GPTQ checkpoint of the same model (``benchmarks.gptq_rtn``) through our engine at batch
   1 and 16: ms per decode step against the bf16 model's.
6b. ``gemv`` (no model needed; after ``gptq``, before the engine's later variants): the batch-1 projections of
   the model's shapes (fused QKV, O, fused gate-up, down, the head), cuBLAS's ``F.linear`` against our Triton GEMV
   (``serving.engine.triton_gemv``): µs a call, weight bytes read a second against the copy bandwidth, the error
   against fp32, and the sum over one decode step's projections; then the 4-bit GEMV (``triton_int4``, group size
   128) on the four quantized shapes at each ``GEMV_TILE_WORDS`` it takes, against the bf16 projection on cuBLAS.
   The engine variant ``ours-triton-gemv`` (batch 1 only) serves with the dense GEMV.
7. ``profile``: decode-only steps at batch 1 and 64 under ``torch.profiler``, per engine variant (graphs on and
   off): kernel launches (``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaGraphLaunch``...) and host syncs
   (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking ``cudaMemcpy``) per step,
   the GPU's busy time against the step's wall time, and the kernels that take the most of it.
   On CPU it counts aten ops instead, so the dry run exercises the path. It runs with each variant's engine of
   section 3 (one load per variant), when selected and paid for.

    python3 benchmarks/gpu_serving.py --out $OUT --budget-s 300            # the device (benchmarks/gpu_check.sh)
    .venv/bin/python benchmarks/gpu_serving.py --device cpu --shape tiny --out /tmp/dry   # the CPU dry run
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.stream_load import make_prompts, make_shapes  # noqa: E402

SECTIONS = ("facts", "gemv", "model", "engine", "hf", "http", "gptq", "profile")
VARIANTS: dict[str, dict[str, Any]] = {
    "ours": {"async_scheduling": True},  # the GPU's default, set so the CPU dry run takes the same path
    "ours-eager": {"enforce_eager": True},
    "ours-torch": {"attention_backend": "torch", "enforce_eager": True},
    "ours-triton-gemv": {},
    "ours-sync": {"async_scheduling": False},  # one step at a time: what async scheduling buys
}
# what a variant sets in the environment while its engine loads, and the batches it runs (default: the plan's)
VARIANT_ENV: dict[str, dict[str, str]] = {"ours-triton-gemv": {"LLM_LIFECYCLE_GPU_GEMV": "triton"}}
VARIANT_BATCHES: dict[str, list[int]] = {"ours-triton-gemv": [1],  # more rows stay on cuBLAS
                                         "ours-sync": [1, 64]}  # where the host's share of a step is largest
HF_BATCH_ORDER = (64, 256, 1, 16)  # the batches the goals compare with HF first: a short budget keeps them
RESULTS_NAME = "gpu_serving.json"
SERVER_PID_NAME = "http_server.pid"  # under --work: gpu_check.sh stops a server this process could not
# CUDA runtime and driver calls, by name prefix: kernel launches (graph replays apart) and calls that block the host
LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch")
GRAPH_LAUNCH_PREFIXES = ("cudaGraphLaunch", "cuGraphLaunch")
BLOCKING_COPY_PREFIXES = ("cudaMemcpy", "cuMemcpy")  # without "Async" in the name
STEP_MARK = "gpu_check.step"


@dataclass
class ModelShape:
    """A Llama-3-shaped config: the 1B of the issue's goals, or a tiny one for the CPU dry run."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int


SHAPES = {
    "1b": ModelShape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=32000, max_positions=4096),
    # hidden and intermediate are multiples of 128, so the GPTQ section's group size 128 fits the tiny model too
    "tiny": ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512, max_positions=512),
}


@dataclass
class Plan:
    """What the run measures and what each section is expected to cost (seconds) on this device, so a section the
    budget cannot pay for is skipped with its reason instead of being cut off halfway."""

    batches: list[int]
    max_tokens: int
    prompt_range: tuple[int, int]
    max_num_batched_tokens: int
    kv_memory_bytes: int | None
    http_streams: int
    http_requests: int
    profile_batch: int
    profile_steps: int
    hf_compile: bool
    needs: dict[str, float] = field(default_factory=dict)


def default_plan(device: str, shape: str) -> Plan:
    if shape == "1b":
        plan = Plan(batches=[1, 16, 64, 256], max_tokens=128, prompt_range=(32, 512), max_num_batched_tokens=8192,
                    kv_memory_bytes=12 * 2 ** 30, http_streams=64, http_requests=128, profile_batch=64,
                    profile_steps=5, hf_compile=device == "cuda")
    else:
        plan = Plan(batches=[1, 4], max_tokens=8, prompt_range=(8, 32), max_num_batched_tokens=512,
                    kv_memory_bytes=None, http_streams=16, http_requests=16, profile_batch=64, profile_steps=2,
                    hf_compile=device == "cuda")
    gpu = device == "cuda"
    # what one unit costs: a section, an engine variant, an HF batch, a compile (measured ones replace the guess)
    plan.needs = {"facts": 10 if gpu else 2, "gemv": 40 if gpu else 10, "model": 30 if gpu else 5,
                  "engine": 40 if gpu else 8,
                  "hf": 20 if gpu else 4, "hf_compile": 90 if gpu else 60, "http": 45 if gpu else 25,
                  "gptq": 45 if gpu else 10, "profile": 8 if gpu else 2}
    return plan


# ----------------------------------------------------------------------------- the JSON and the budget
class Budget:
    """Seconds left of ``total`` since the run started (the device's timeout is the hard stop; this is the soft one
    that skips what would not finish)."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.t0 = time.monotonic()

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.t0)


class Report:
    """The results file: rewritten whole (temp file, then rename) after every change, so it is always valid JSON
    holding every row measured so far, however the process ends."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "sections": {}, "summary": {}, "interrupted": False}
        self.save()

    def section(self, name: str) -> dict[str, Any]:
        return self.data["sections"].setdefault(name, {"status": "pending", "rows": [], "skipped": []})

    def set(self, name: str, **fields: Any) -> None:
        self.section(name).update(fields)
        self.save()

    def row(self, name: str, row: dict[str, Any]) -> None:
        self.section(name)["rows"].append(row)
        print(f"  {name}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        self.save()

    def skip_row(self, name: str, what: str, reason: str) -> None:
        """Part of a section (a batch, a variant) left out, and why."""
        self.section(name)["skipped"].append({"what": what, "reason": reason})
        print(f"  {name}: skipped {what}: {reason}", flush=True)
        self.save()

    def rows(self, name: str) -> list[dict[str, Any]]:
        return self.data["sections"].get(name, {}).get("rows", [])

    def save(self) -> None:
        self.data["summary"] = summarize(self.data)
        self.data["meta"]["saved_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def run_section(report: Report, budget: Budget, name: str, selected: set[str], need_s: float,
                body: Callable[[], Any], missing: str | None = None) -> Any:
    """Run one section: skipped when not selected, when an input it needs is ``missing`` or when the budget left
    is under ``need_s``; its exception is recorded (with the traceback's tail) and the run goes on."""
    if name not in selected:
        return None
    if missing:
        report.set(name, status="skipped", reason=missing)
        return None
    if budget.left() < need_s:
        report.set(name, status="skipped", reason=f"budget: {budget.left():.0f} s left, needs about {need_s:.0f} s")
        return None
    print(f"== {name} ({budget.left():.0f} s left)", flush=True)
    t0 = time.monotonic()
    report.set(name, status="running")
    try:
        result = body()
    except Exception as exc:  # noqa: BLE001 - a section's failure is a result; the later sections still run
        report.set(name, status="error", error=f"{type(exc).__name__}: {exc}",
                   traceback=traceback.format_exc()[-3000:], seconds=round(time.monotonic() - t0, 2))
        print(f"  {name}: ERROR {type(exc).__name__}: {exc}", flush=True)
        return None
    report.set(name, status="ok", seconds=round(time.monotonic() - t0, 2))
    return result


# ----------------------------------------------------------------------------- helpers
def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def free_device(device: str) -> None:
    """Drop what the previous section left (an engine's cache, HF's compiled graphs) before the next one sizes
    itself from free memory."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def batch_prompts(plan: Plan, vocab: int, batch: int, seed: int) -> list[list[int]]:
    """Seeded token-id prompts of mixed lengths; ``seed`` alone fixes them, so ours and HF get the same ones and a
    warm-up (another seed) shares no prefix with the timed run."""
    shapes = make_shapes(batch, seed, plan.prompt_range, (plan.max_tokens, plan.max_tokens))
    return make_prompts(shapes, vocab, seed)


# ----------------------------------------------------------------------------- 1. facts
def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written, median of ``repeats``."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def device_facts(device: str) -> dict[str, Any]:
    import torch
    import transformers

    from benchmarks.servers import machine_facts

    facts: dict[str, Any] = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                             "python": platform.python_version(), "host": machine_facts()}
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError as exc:
        facts["triton"] = f"not importable: {exc}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                     capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                     multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    nbytes = 2 ** 30 if device == "cuda" else 64 * 2 ** 20
    facts["copy_bandwidth_gbs"] = round(copy_bandwidth(device, nbytes) / 1e9, 1)
    return facts


# ----------------------------------------------------------------------------- 1b. gemv
def projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """[N, K] of each projection a decode step runs, fused as the engine fuses them."""
    head = shape.hidden // shape.heads
    return {"qkv": ((shape.heads + 2 * shape.kv_heads) * head, shape.hidden), "o": (shape.hidden, shape.hidden),
            "gate_up": (2 * shape.intermediate, shape.hidden), "down": (shape.hidden, shape.intermediate),
            "lm_head": (shape.vocab, shape.hidden)}


def time_call(fn: Callable[[], Any], device: str, reps: int) -> float:
    """Microseconds one call takes, over ``reps`` calls back to back (CUDA events on a GPU)."""
    import torch

    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e6 / reps


def measure_gemv(report: Report, device: str, shape: ModelShape, copy_gbs: float | None) -> None:
    """Section ``gemv``: cuBLAS against the Triton GEMV on each projection at one row (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from serving.engine.triton_gemv import dense_gemv

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    reps = 200 if device == "cuda" else 2
    gen = torch.Generator(device=device).manual_seed(0)
    step = {"cublas": 0.0, "triton": 0.0}
    dense_us: dict[str, float] = {}  # cuBLAS's time per projection, what the 4-bit rows are compared with
    for name, (n, k) in projection_shapes(shape).items():
        w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)
        x = torch.randn(1, k, device=device, generator=gen).to(dtype)
        ref = F.linear(x.float(), w.float())
        nbytes = w.numel() * w.element_size()
        row: dict[str, Any] = {"projection": name, "n": n, "k": k, "weight_mb": round(nbytes / 1e6, 2)}
        for impl, gemv in (("cublas", F.linear), ("triton", dense_gemv)):
            fn = functools.partial(gemv, x, w)
            out = fn()  # compiles the kernel for this shape before it is timed
            row[f"{impl}_rel_err"] = float(f"{((out.float() - ref).abs().max() / ref.abs().max()).item():.2e}")
            us = time_call(fn, device, reps)
            row[f"{impl}_us"], row[f"{impl}_gbs"] = round(us, 2), round(nbytes / us / 1e3, 1)
            if copy_gbs:
                row[f"{impl}_of_copy"] = round(nbytes / us / 1e3 / copy_gbs, 3)
            step[impl] += us * (1 if name == "lm_head" else shape.layers)
            if impl == "cublas":
                dense_us[name] = us
        row["triton_over_cublas"] = round(row["triton_us"] / row["cublas_us"], 3)
        report.row("gemv", row)
    report.row("gemv", {"projection": "one decode step", "cublas_us": round(step["cublas"], 1),
                        "triton_us": round(step["triton"], 1),
                        "triton_over_cublas": round(step["triton"] / step["cublas"], 3)})
    measure_int4_gemv(report, device, shape, copy_gbs, dense_us, reps)


def measure_int4_gemv(report: Report, device: str, shape: ModelShape, copy_gbs: float | None,
                      dense_us: dict[str, float], reps: int) -> None:
    """The 4-bit GEMV (``triton_int4``, group size 128) on the same shapes at each words-per-step setting it can
    take (``GEMV_TILE_WORDS``): the tuning the issue asks for, and its time against the bf16 projection on cuBLAS
    (the goal: 0.6x at batch 1)."""
    import torch

    from serving.engine import triton_int4

    default = triton_int4.GEMV_TILE_WORDS
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        for name, (n, k) in projection_shapes(shape).items():
            if k % 128 or name == "lm_head":  # a GPTQ/AWQ bundle keeps its head in bf16
                continue
            codes = torch.randint(0, 16, (n, k), device=device, generator=gen, dtype=torch.uint8)
            scales = (torch.rand(n, k // 128, device=device, generator=gen) * 0.01 + 0.001).half()
            zeros = torch.randint(0, 16, (n, k // 128), device=device, generator=gen, dtype=torch.uint8)
            layer = triton_int4.TritonInt4Linear.from_codes(codes, scales, zeros)
            x = torch.randn(1, k, device=device, generator=gen).to(dtype)
            # at least one plane of the widest block (32 x 64 outputs); the interpreter on CPU runs the default only
            for words in (2048, 4096, 8192) if device == "cuda" else (default,):
                triton_int4.GEMV_TILE_WORDS = words
                fn = functools.partial(layer, x)
                try:
                    fn()  # compiles this setting
                except Exception as exc:  # noqa: BLE001 - a setting the chip cannot hold is a result too
                    report.skip_row("gemv", f"int4 {name} at {words} words", f"{type(exc).__name__}: {exc}")
                    continue
                us = time_call(fn, device, reps)
                row = {"projection": name, "n": n, "k": k, "int4_tile_words": words, "int4_us": round(us, 2),
                       "int4_gbs": round(layer.nbytes / us / 1e3, 1),
                       "int4_over_bf16_cublas": round(us / dense_us[name], 3)}
                if copy_gbs:
                    row["int4_of_copy"] = round(layer.nbytes / us / 1e3 / copy_gbs, 3)
                report.row("gemv", row)
    finally:
        triton_int4.GEMV_TILE_WORDS = default


# ----------------------------------------------------------------------------- 2. model
def build_model(shape: ModelShape, device: str, out: Path) -> dict[str, Any]:
    """A random-init Llama of ``shape`` (bf16 on a GPU, fp32 on CPU), initialised on the device (a 1B init on the
    CPU would take minutes), saved to ``out``. No eos token: HF ``generate`` then never stops early either."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.bench_model import tensor_bytes

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                         initializer_range=0.02)
    t0 = time.monotonic()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    sync(device)
    init_s = time.monotonic() - t0
    model.save_pretrained(str(out))
    del model
    free_device(device)
    sizes = tensor_bytes(out)
    weights = sum(sizes.values())
    embedding = sum(v for k, v in sizes.items() if "embed_tokens" in k)
    return {"dir": str(out), "dtype": str(dtype).removeprefix("torch."), "params_m": round(weights / (
        2 if device == "cuda" else 4) / 1e6, 1), "weight_bytes": weights,
        # a decode step streams every weight but the embedding table (a gather of a few rows)
        "step_weight_bytes": weights - embedding, "init_s": round(init_s, 2),
        "total_s": round(time.monotonic() - t0, 2), "shape": asdict(shape)}


def write_http_model_dir(model_dir: Path, out: Path, vocab: int) -> Path:
    """``model_dir``'s files (links) plus a word-level tokenizer covering the whole vocabulary: every id decodes to
    a short ASCII word, so the server detokenises each token as in production and no id is left undecodable."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = {tok: i for i, tok in enumerate(specials)}
    words.update({f"w{i}": i for i in range(len(specials), vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(out))
    return out


# ----------------------------------------------------------------------------- 3. our engine
def engine_config(device: str, plan: Plan, max_seqs: int, overrides: dict[str, Any]):
    from serving.engine import EngineConfig

    return EngineConfig(device=device, max_num_seqs=max_seqs, max_num_batched_tokens=plan.max_num_batched_tokens,
                        kv_memory_bytes=plan.kv_memory_bytes, max_queue=max(256, 2 * max_seqs), **overrides)


def run_batch(engine, prompts: list[list[int]], max_tokens: int, device: str, tag: str) -> dict[str, Any]:
    """Every prompt in at once, stepped to the end. The host times each step without a device sync (a sync per
    step would undo any overlap of host and GPU work): a step's outputs mean its tokens reached the host. The last
    timestamp comes after a full sync."""
    from serving.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    n = len(prompts)
    sync(device)
    tokens0, steps0 = engine.generation_tokens_total, engine.num_steps
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    started: set[str] = set()
    all_started: tuple[float, int, int] | None = None  # time, tokens, steps when the last sequence got a token
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            if o.finish_reason == "error":
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            if o.delta_token_ids or o.token_ids:
                started.add(o.request_id)
        if all_started is None and len(started) == n:
            all_started = (time.perf_counter(), engine.generation_tokens_total - tokens0, engine.num_steps - steps0)
    sync(device)
    wall = time.perf_counter() - t0
    tokens, steps = engine.generation_tokens_total - tokens0, engine.num_steps - steps0
    if tokens != n * max_tokens:
        raise RuntimeError(f"{tokens} tokens generated, expected {n} x {max_tokens} (ignore_eos)")
    if all_started is None:
        raise RuntimeError("the run ended before every sequence had a token")
    t_first, tok_first, steps_first = all_started
    decode_s, decode_tokens, decode_steps = t0 + wall - t_first, tokens - tok_first, steps - steps_first
    return {"batch": n, "max_tokens": max_tokens, "prompt_tokens": sum(map(len, prompts)), "tokens": tokens,
            "wall_s": round(wall, 4), "total_tok_s": round(tokens / wall, 1),
            "all_first_token_s": round(t_first - t0, 4), "steps": steps, "decode_steps": decode_steps,
            "decode_tok_s": round(decode_tokens / decode_s, 1) if decode_s > 0 and decode_tokens else None,
            "decode_ms_per_step": round(decode_s * 1e3 / decode_steps, 3) if decode_steps else None}


def engine_facts(engine, device: str) -> dict[str, Any]:
    """What the engine chose (attention backend, graphs) and its memory peak: a variant that silently fell back
    is visible in its rows."""
    import torch

    runner = engine.runner
    facts = {"attention_backend": getattr(runner, "attention_backend", None),
             "decode_graphs": getattr(runner, "graphs", None) is not None, "num_blocks": runner.num_blocks,
             "async_scheduling": engine.async_scheduling,
             "dtype": str(runner.dtype).removeprefix("torch.")}
    if device == "cuda":
        facts["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    return facts


def measure_engine(report: Report, budget: Budget, plan: Plan, device: str, model_dir: Path, vocab: int,
                   floor_ms: float | None, variants: list[str], selected: set[str]) -> None:
    """Each variant: load, warm up, every batch size (section ``engine``), then its decode-step profile (section
    ``profile``), on one load of the model per variant."""
    import torch

    from serving.engine import LLMEngine

    profiling = "profile" in selected
    max_seqs = max(plan.batches + ([plan.profile_batch] if profiling else []))
    for name in variants:
        if budget.left() < plan.needs["engine"]:
            report.skip_row("engine", name, f"budget: {budget.left():.0f} s left")
            continue
        engine = None
        env = VARIANT_ENV.get(name, {})
        saved = {key: os.environ.get(key) for key in env}
        try:
            t0 = time.monotonic()
            os.environ.update(env)  # read while the engine loads (which GEMM each projection runs)
            engine = LLMEngine.from_pretrained(model_dir, engine_config(device, plan, max_seqs, VARIANTS[name]))
            load = {"load_s": round(time.monotonic() - t0, 2)}
            run_batch(engine, batch_prompts(plan, vocab, min(4, max_seqs), seed=990), 4, device, f"{name}-warm")
            batches = [b for b in plan.batches if b in VARIANT_BATCHES.get(name, plan.batches)]
            for batch in batches if "engine" in selected else []:
                if budget.left() < 5:
                    report.skip_row("engine", f"{name} batch {batch}", f"budget: {budget.left():.0f} s left")
                    continue
                run_batch(engine, batch_prompts(plan, vocab, batch, seed=5000 + batch), min(8, plan.max_tokens),
                          device, f"{name}-{batch}-warm")
                row = {"variant": name} | run_batch(engine, batch_prompts(plan, vocab, batch, seed=batch),
                                                    plan.max_tokens, device, f"{name}-{batch}")
                if floor_ms and row["decode_ms_per_step"]:
                    row["x_floor"] = round(row["decode_ms_per_step"] / floor_ms, 2)
                report.row("engine", row | engine_facts(engine, device) | load)
            if profiling:
                profile_variant(report, budget, plan, device, vocab, engine, name)
        except Exception as exc:  # noqa: BLE001 - one variant failing leaves the others to run
            report.skip_row("engine", name, f"error: {type(exc).__name__}: {exc}")
            report.section("engine").setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            report.save()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            del engine
            free_device(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------- 7. profile (with each engine)
def profile_variant(report: Report, budget: Budget, plan: Plan, device: str, vocab: int, engine, name: str) -> None:
    """Section ``profile``'s row for one variant, its failure recorded there (the engine's rows stand)."""
    if budget.left() < plan.needs["profile"]:
        report.skip_row("profile", name, f"budget: {budget.left():.0f} s left")
        return
    for batch in sorted({1, plan.profile_batch}):  # batch 1: the floor's case; the plan's: a full step
        try:
            row = profile_decode(engine, plan, device, vocab, batch)
        except Exception as exc:  # noqa: BLE001 - the other variants' profiles still run
            report.skip_row("profile", f"{name} batch {batch}", f"error: {type(exc).__name__}: {exc}")
            continue
        report.row("profile", {"variant": name} | row | engine_facts(engine, device))


def profile_decode(engine, plan: Plan, device: str, vocab: int, batch: int) -> dict[str, Any]:
    """``plan.profile_steps`` decode-only steps of ``batch`` sequences under torch.profiler: CUDA runtime launches
    and blocking calls (or aten ops on CPU) per step, counting only what runs inside a step; the GPU's busy time
    against the step's wall time, and the kernels that take the most of it."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from serving.engine import SamplingParams

    prompts = make_prompts(make_shapes(batch, 77, (16, 64), (1, 1)), vocab, 77)
    params = SamplingParams(temperature=0, max_tokens=plan.profile_steps + 64, ignore_eos=True)
    ids = [f"profile-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    try:
        started: set[str] = set()
        for _ in range(200):  # every prompt prefilled: from here on the steps are decode-only
            started.update(o.request_id for o in engine.step() if o.delta_token_ids or o.token_ids)
            if len(started) == batch:
                break
        if len(started) < batch:
            raise RuntimeError(f"only {len(started)} of {batch} sequences started decoding")
        for _ in range(3):
            engine.step()
        sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(plan.profile_steps):
                with record_function(STEP_MARK):
                    engine.step()
            sync(device)
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    return count_step_events(prof.events(), plan.profile_steps, batch)


def count_step_events(events, steps: int, batch: int) -> dict[str, Any]:
    """Per-step counts of the host-side events that start inside a ``STEP_MARK`` range: CUDA runtime and driver
    calls (launches, graph launches, host syncs, each call by name) and aten ops; device-side records (kernels,
    copies) are counted over the whole profiled window, which holds only the steps."""
    host = [e for e in events if e.device_type.name == "CPU"]
    marks = [(e.time_range.start, e.time_range.end) for e in host if e.name == STEP_MARK]
    if len(marks) != steps:
        raise RuntimeError(f"profiler: {len(marks)} step ranges for {steps} steps")
    calls: dict[str, int] = {}
    aten = 0
    for e in host:
        if e.name == STEP_MARK or not any(lo <= e.time_range.start <= hi for lo, hi in marks):
            continue
        if e.name.startswith("cuda") or (e.name.startswith("cu") and e.name[2:3].isupper()):
            calls[e.name] = calls.get(e.name, 0) + 1
        elif e.name.startswith("aten::"):
            aten += 1

    def per_step(match: Callable[[str], bool]) -> float:
        return round(sum(n for name, n in calls.items() if match(name)) / steps, 2)

    kernels: dict[str, list[float]] = {}
    for e in events:
        # the step's own range shows on the GPU timeline too (a user annotation, not a kernel): left out
        if e.device_type.name == "CUDA" and e.name != STEP_MARK:
            kernels.setdefault(e.name[:80], []).append(e.time_range.end - e.time_range.start)
    busy_us = sum(sum(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]

    return {"batch": batch, "steps": steps,
            "launches_per_step": per_step(lambda n: n.startswith(LAUNCH_PREFIXES)),
            "graph_launches_per_step": per_step(lambda n: n.startswith(GRAPH_LAUNCH_PREFIXES)),
            "host_syncs_per_step": per_step(lambda n: "Synchronize" in n or (
                n.startswith(BLOCKING_COPY_PREFIXES) and "Async" not in n)),
            "aten_ops_per_step": round(aten / steps, 2),
            "gpu_events_per_step": round(sum(e.device_type.name == "CUDA" for e in events) / steps, 2),
            "step_wall_ms": round(sum(hi - lo for lo, hi in marks) / steps / 1e3, 3),
            "gpu_busy_ms_per_step": round(busy_us / steps / 1e3, 3),
            "top_kernels_us_per_step": {name: [round(sum(v) / steps, 1), round(len(v) / steps, 1)]
                                        for name, v in top},
            "cuda_calls_per_step": {k: round(v / steps, 2) for k, v in sorted(calls.items())}}


# ----------------------------------------------------------------------------- 4. HF generate
def hf_batch_order(batches: list[int]) -> list[int]:
    return [b for b in HF_BATCH_ORDER if b in batches] + [b for b in batches if b not in HF_BATCH_ORDER]


def measure_hf(report: Report, budget: Budget, plan: Plan, device: str, model_dir: Path, vocab: int,
               reserve_s: float) -> None:
    """HF ``generate`` on our prompts, left-padded: eager (DynamicCache), then a static cache (compiled by
    transformers on a GPU; ``disable_compile`` where ``plan.hf_compile`` is off). The eager rows are cheap and come
    first; a compile (minutes, unbounded) that would eat into ``reserve_s``, kept for the sections after this one,
    is skipped."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    compile_guess = plan.needs["hf_compile"]
    static_error = None  # a static-cache failure (a compile error) is recorded once, not retried per batch
    try:
        warm_ids, warm_mask = left_pad(batch_prompts(plan, vocab, 1, seed=992), device)
        hf_generate(model, warm_ids, warm_mask, 2, device, 0.0, static=False)  # first-call costs out of the rows
        for batch in hf_batch_order(plan.batches):
            prompts = batch_prompts(plan, vocab, batch, seed=batch)
            ids, mask = left_pad(prompts, device)
            if budget.left() < plan.needs["hf"]:
                report.skip_row("hf", f"batch {batch}", f"budget: {budget.left():.0f} s left")
                continue
            prefill_s = hf_prefill_s(model, ids, mask, device)
            report.row("hf", {"variant": "hf-eager", "batch": batch, "compiled": False}
                       | hf_generate(model, ids, mask, plan.max_tokens, device, prefill_s, static=False))
            need = (compile_guess if plan.hf_compile else 0) + plan.needs["hf"] + reserve_s
            if static_error or budget.left() < need:
                report.skip_row("hf", f"hf-static batch {batch}", static_error or (
                    f"budget: {budget.left():.0f} s left, needs about {need:.0f} s with the compile"))
                continue
            try:
                t0 = time.perf_counter()
                hf_generate(model, ids, mask, plan.max_tokens, device, prefill_s, static=True,
                            compile=plan.hf_compile)
                first_s = time.perf_counter() - t0
                row, walls = hf_settled(partial(hf_generate, model, ids, mask, plan.max_tokens, device, prefill_s,
                                                static=True, compile=plan.hf_compile))
            except Exception as exc:  # noqa: BLE001 - a compile failure leaves the eager rows to measure
                static_error = f"error at batch {batch}: {type(exc).__name__}: {exc}"[:2000]
                report.skip_row("hf", f"hf-static batch {batch}", static_error)
                continue
            compile_s = max(first_s - row["wall_s"], 0.0)
            compile_guess = max(compile_s * 1.2, 10.0)  # the next batch size compiles again
            report.row("hf", {"variant": "hf-static", "batch": batch, "compiled": plan.hf_compile,
                              "first_call_s": round(first_s, 2), "compile_s": round(compile_s, 2),
                              "timed_walls_s": walls} | row)
    finally:
        del model
        if plan.hf_compile:
            torch._dynamo.reset()  # its CUDA-graph pools hold memory the later sections want
        free_device(device)


def hf_settled(call: Callable[[], dict[str, Any]], most: int = 3) -> tuple[dict[str, Any], list[float]]:
    """The fastest of up to ``most`` timed calls, stopping once two in a row agree within 15 %: a compiled
    ``generate`` can still be recompiling or recording graphs on its second call, which is not its speed."""
    rows: list[dict[str, Any]] = []
    for _ in range(most):
        rows.append(call())
        last, before = rows[-1]["wall_s"], rows[-2]["wall_s"] if len(rows) > 1 else None
        if before is not None and abs(last - before) <= 0.15 * min(last, before):
            break
    return min(rows, key=lambda r: r["wall_s"]), [r["wall_s"] for r in rows]


def left_pad(prompts: list[list[int]], device: str):
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def hf_prefill_s(model, ids, mask, device: str) -> float:
    """One forward over the padded prompts, the last position's logits only: ``generate``'s prefill runs this
    uncompiled in both variants, so decode time is a run's time less this."""
    import torch

    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)  # warm
        times = []
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)
            sync(device)
            times.append(time.perf_counter() - t0)
    return min(times)


def hf_generate(model, ids, mask, max_tokens: int, device: str, prefill_s: float, static: bool,
                compile: bool = False) -> dict[str, Any]:
    """One timed greedy ``generate`` of exactly ``max_tokens`` new tokens per row."""
    import torch

    kwargs: dict[str, Any] = {"cache_implementation": "static", "disable_compile": not compile} if static else {}
    if static and compile and device != "cuda":
        from transformers import CompileConfig

        kwargs["compile_config"] = config = CompileConfig()
        config._compile_all_devices = True  # transformers compiles on GPUs only unless told (its testing switch)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kwargs)
    sync(device)
    wall = time.perf_counter() - t0
    batch, width = ids.shape
    if out.shape[1] != width + max_tokens:
        raise RuntimeError(f"generate made {out.shape[1] - width} tokens, expected {max_tokens}")
    decode_s = wall - prefill_s
    ok = decode_s > 0 and max_tokens > 1  # else the timer noise exceeds the decode time: no decode figures
    return {"tokens": batch * max_tokens, "padded_prompt_tokens": batch * width, "wall_s": round(wall, 4),
            "total_tok_s": round(batch * max_tokens / wall, 1), "prefill_s": round(prefill_s, 4),
            "decode_tok_s": round(batch * (max_tokens - 1) / decode_s, 1) if ok else None,
            "decode_ms_per_step": round(decode_s * 1e3 / (max_tokens - 1), 3) if ok else None}


# ----------------------------------------------------------------------------- 5. HTTP
def measure_http(report: Report, budget: Budget, plan: Plan, device: str, http_dir: Path, vocab: int,
                 work: Path, log_path: Path) -> None:
    """Our server (engine process) on ``http_dir``; a warm-up load, then ``plan.http_requests`` streams at
    ``plan.http_streams`` concurrency through ``benchmarks.stream_load``."""
    import asyncio

    from artifacts.common.stats import percentile
    from benchmarks.servers import SERVED_NAME, Child, free_port, stop_all, wait_ready
    from benchmarks.stream_load import run_load, scrape, summarize

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "serving.cli", "serve", str(http_dir), "--port", str(port), "--served-model-name",
            SERVED_NAME, "--log-level", "warning", "--drain-timeout", "1", "--engine-process", "--device", device,
            "--max-num-seqs", str(max(plan.http_streams, 1)), "--max-num-batched-tokens",
            str(plan.max_num_batched_tokens)]
    if plan.kv_memory_bytes:
        args += ["--kv-memory", str(plan.kv_memory_bytes)]
    children: list = []
    pid_file = work / SERVER_PID_NAME
    try:
        t0 = time.monotonic()
        children.append(Child("server", args, log_path, dict(os.environ)))
        pid_file.write_text(str(children[0].pid))  # before the wait: a SIGKILL now leaves gpu_check.sh the pid
        wait_ready(children[0], url, timeout_s=max(budget.left() - 20, 10))
        start_s = time.monotonic() - t0

        async def drive() -> tuple[dict, dict]:
            import httpx

            limits = httpx.Limits(max_connections=plan.http_streams + 4)
            async with httpx.AsyncClient(timeout=httpx.Timeout(300), limits=limits) as client:
                warm = make_shapes(plan.http_streams, 98, plan.prompt_range, (4, 4))
                await run_load(client, url, {}, make_prompts(warm, vocab, 98), warm, plan.http_streams)
                names = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
                         "vllm:engine_steps_total", "vllm:engine_steps_overlapped_total")
                before = await scrape(client, url, names)
                shapes = make_shapes(plan.http_requests, 7, plan.prompt_range, (plan.max_tokens, plan.max_tokens))
                streams = await run_load(client, url, {}, make_prompts(shapes, vocab, 7), shapes, plan.http_streams)
                after = await scrape(client, url, names)
                # the server's own TTFT (request sent to the engine core -> first token sampled there) against the
                # client's: the difference is the API process and the client, not the engine
                count = after[names[1]] - before[names[1]]
                server = {"server_ttft_mean_ms": (after[names[0]] - before[names[0]]) / count * 1e3 if count else 0.0}
                # the engine core's steps under this load, and the share whose wait came after the next launch
                steps = after[names[2]] - before[names[2]]
                server["engine_steps"] = steps
                server["steps_overlapped_share"] = (after[names[3]] - before[names[3]]) / steps if steps else 0.0
                # the same arrivals with one token each: admission and prefill alone, no streams to keep up with
                first = make_shapes(plan.http_streams, 8, plan.prompt_range, (1, 1))
                alone = await run_load(client, url, {}, make_prompts(first, vocab, 8), first, plan.http_streams)
                server["ttft_p50_ms_one_token_requests"] = percentile([s.token_times[0] - s.sent for s in alone],
                                                                      50) * 1e3
                return summarize(streams, shapes) | server, tails(streams)

        def tails(streams) -> dict[str, float]:
            ttft = [s.token_times[0] - s.sent for s in streams]
            itl = [b - a for s in streams for a, b in zip(s.token_times, s.token_times[1:])]
            return {"ttft_p95_ms": percentile(ttft, 95) * 1e3, "itl_p95_ms": percentile(itl, 95) * 1e3}

        summary, p95 = asyncio.run(drive())
        row = {"streams": plan.http_streams, "requests": plan.http_requests, "max_tokens": plan.max_tokens,
               "server_start_s": round(start_s, 1), "tokenizer": True}
        row |= {k: round(v, 3) for k, v in (summary | p95).items()}
        report.row("http", row)
    except BaseException:
        if children:
            report.set("http", server_log_tail=children[0].tail(40))
        raise
    finally:
        stop_all(children)
        pid_file.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- 6. GPTQ
def measure_gptq(report: Report, budget: Budget, plan: Plan, device: str, model_dir: Path, vocab: int,
                 work: Path) -> None:
    """The RTN 4-bit checkpoint of the same model through our engine at batch 1 and 16, against ``ours``."""
    from benchmarks.gptq_rtn import write_rtn_gptq_checkpoint  # another module's job; absent: the error says so
    from serving.engine import LLMEngine

    out = work / "model-gptq"
    t0 = time.monotonic()
    write_rtn_gptq_checkpoint(model_dir, out, group_size=128)
    report.set("gptq", write_s=round(time.monotonic() - t0, 2))
    batches = [b for b in (1, 16) if b <= max(plan.batches)] or [1]
    engine = LLMEngine.from_pretrained(out, engine_config(device, plan, max(batches), {}))
    try:
        run_batch(engine, batch_prompts(plan, vocab, min(4, max(batches)), seed=991), 4, device, "gptq-warm")
        bf16 = {r["batch"]: r for r in report.rows("engine") if r.get("variant") == "ours"}
        for batch in batches:
            if budget.left() < 5:
                report.skip_row("gptq", f"batch {batch}", f"budget: {budget.left():.0f} s left")
                continue
            run_batch(engine, batch_prompts(plan, vocab, batch, seed=5000 + batch), min(8, plan.max_tokens),
                      device, f"gptq-{batch}-warm")
            row = {"variant": "gptq-rtn-4bit"} | run_batch(engine, batch_prompts(plan, vocab, batch, seed=batch),
                                                           plan.max_tokens, device, f"gptq-{batch}")
            ref = bf16.get(batch, {}).get("decode_ms_per_step")
            if ref and row["decode_ms_per_step"]:
                row["x_bf16_ms_per_step"] = round(row["decode_ms_per_step"] / ref, 3)
            report.row("gptq", row | engine_facts(engine, device))
    finally:
        del engine
        free_device(device)


# ----------------------------------------------------------------------------- summary and table
def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Ratios per batch (ours total and decode tok/s over HF's) and batch 1 against the HBM floor, recomputed
    from the rows at every save."""
    sections = data.get("sections", {})
    engine = sections.get("engine", {}).get("rows", [])
    hf = sections.get("hf", {}).get("rows", [])
    out: dict[str, Any] = {"floor_ms_per_step": data.get("meta", {}).get("floor_ms_per_step")}
    ratios = []
    for r in engine:
        for h in hf:
            if h["batch"] != r["batch"]:
                continue
            ratios.append({"ours": r["variant"], "hf": h["variant"], "hf_compiled": h.get("compiled"),
                           "batch": r["batch"], "total_tok_s": round(r["total_tok_s"] / h["total_tok_s"], 3),
                           "decode_tok_s": round(r["decode_tok_s"] / h["decode_tok_s"], 3)
                           if r.get("decode_tok_s") and h.get("decode_tok_s") else None})
    out["ours_over_hf"] = ratios
    out["batch1_x_floor"] = {r["variant"]: r.get("x_floor") for r in engine if r["batch"] == 1}
    return out


def table(data: dict[str, Any]) -> str:
    """The short text table printed at the end (the JSON has everything)."""
    lines = []
    meta = data["meta"]
    lines.append(f"device: {meta.get('gpu') or meta.get('device')}, floor {meta.get('floor_ms_per_step')} ms/step")
    for name, sec in data["sections"].items():
        lines.append(f"[{name}] {sec['status']}" + (f": {sec.get('reason') or sec.get('error')}"
                                                     if sec["status"] in ("skipped", "error") else ""))
        for r in sec.get("rows", []):
            if name in ("engine", "hf", "gptq"):
                lines.append(f"  {r['variant']:<14} b={r['batch']:<4} total {r['total_tok_s']:>9.1f} tok/s  decode "
                             f"{_fmt(r.get('decode_tok_s')):>8} tok/s  {_fmt(r.get('decode_ms_per_step')):>7} ms/step"
                             + (f"  compile {r['compile_s']} s" if r.get("compiled") else ""))
            elif name == "http":
                lines.append(f"  {r['streams']} streams: {r['output_tok_s']:.0f} tok/s, TTFT p50 "
                             f"{r['ttft_p50_ms']:.1f} p95 {r['ttft_p95_ms']:.1f} ms, ITL p50 {r['itl_p50_ms']:.2f} "
                             f"p95 {r['itl_p95_ms']:.2f} ms")
            elif name == "gemv" and "int4_us" in r:
                lines.append(f"  {r['projection']:<16} int4 ({r['int4_tile_words']} words a step) {r['int4_us']:>9.2f} "
                             f"us  x{r['int4_over_bf16_cublas']} of bf16 on cuBLAS")
            elif name == "gemv":
                share = (f"  ({r['cublas_of_copy']:.0%} / {r['triton_of_copy']:.0%} of copy bandwidth)"
                         if "triton_of_copy" in r else "")
                lines.append(f"  {r['projection']:<16} cublas {r['cublas_us']:>9.2f} us  triton "
                             f"{r['triton_us']:>9.2f} us  x{r['triton_over_cublas']}{share}")
            elif name == "profile":
                lines.append(f"  {r['variant']:<14} b={r['batch']}: launches {r['launches_per_step']}/step (graphs "
                             f"{r['graph_launches_per_step']}), syncs {r['host_syncs_per_step']}/step, aten ops "
                             f"{r['aten_ops_per_step']}/step, GPU events {r['gpu_events_per_step']}/step")
        for s in sec.get("skipped", []):
            lines.append(f"  skipped {s['what']}: {s['reason']}")
    for r in data["summary"].get("ours_over_hf", []):
        if r["ours"] == "ours":
            lines.append(f"  ours/{r['hf']}{'(compiled)' if r['hf_compiled'] else ''} b={r['batch']}: total "
                         f"x{r['total_tok_s']}, decode x{r['decode_tok_s']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when torch sees one")
    ap.add_argument("--shape", choices=list(SHAPES), default=None, help="default: 1b on cuda, tiny on cpu")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")),
                    help=f"folder of {RESULTS_NAME} (default: $OUT, else ./out)")
    ap.add_argument("--work", type=Path, default=None,
                    help="folder for the model dirs (default: a temporary folder, removed at the end)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="seconds this run may take (soft: sections that "
                    "would not finish are skipped)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile HF's static-cache generate (default: on a GPU only; on CPU it takes minutes)")
    return ap.parse_args(argv)


def make_plan(args: argparse.Namespace) -> tuple[str, str, Plan]:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape or ("1b" if device == "cuda" else "tiny")
    plan = default_plan(device, shape)
    if args.batches:
        plan.batches = sorted(set(args.batches))
    if args.max_tokens:
        plan.max_tokens = args.max_tokens
    if args.hf_compile is not None:
        plan.hf_compile = args.hf_compile
    return device, shape, plan


def run(args: argparse.Namespace, work: Path) -> Report:
    """Every selected section in priority order; the model is built whenever a section needs it."""
    budget = Budget(args.budget_s)
    device, shape_name, plan = make_plan(args)
    shape, selected, model_dir = SHAPES[shape_name], set(args.sections), work / "model"
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / RESULTS_NAME, {"device": device, "shape": shape_name, "budget_s": args.budget_s,
                                              "argv": sys.argv[1:], "plan": asdict(plan),
                                              "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    facts = run_section(report, budget, "facts", selected, plan.needs["facts"], lambda: device_facts(device))
    if facts:
        report.data["meta"].update(facts)
        report.save()
    if selected - {"facts", "gemv"}:
        selected.add("model")
    model = run_section(report, budget, "model", selected, plan.needs["model"],
                        lambda: build_model(shape, device, model_dir))
    no_model = None if model else "no model: the model section did not finish"
    floor_ms = None
    if model:
        report.row("model", model)
        if facts:
            floor_ms = round(model["step_weight_bytes"] / (facts["copy_bandwidth_gbs"] * 1e9) * 1e3, 4)
            report.data["meta"]["floor_ms_per_step"] = floor_ms
            report.save()
    # the first variant (ours as served), then the baselines and the other sections; the other variants (ours
    # without graphs, ours before the Triton path) last, so a short budget keeps what the goals compare
    first, later = args.variants[:1], args.variants[1:]

    def engine_variants(names: list[str], need_s: float) -> None:
        if names and selected & {"engine", "profile"}:  # one engine load per variant serves both
            run_section(report, budget, "engine", selected | {"engine"}, need_s,
                        lambda: measure_engine(report, budget, plan, device, model_dir, shape.vocab, floor_ms,
                                               names, selected), no_model)

    engine_variants(first, plan.needs["engine"])
    # HF's compiles leave this to the sections after them; the later variants come last by design and reserve
    # nothing (the second H200 run reserved for them too and skipped every compiled HF row)
    reserve = sum(plan.needs[k] for k in ("http", "gptq") if k in selected)
    run_section(report, budget, "hf", selected, plan.needs["hf"],
                lambda: measure_hf(report, budget, plan, device, model_dir, shape.vocab, reserve), no_model)
    run_section(report, budget, "http", selected, plan.needs["http"],
                lambda: measure_http(report, budget, plan, device,
                                     write_http_model_dir(model_dir, work / "model-http", shape.vocab), shape.vocab,
                                     work, args.out / "http_server.log"), no_model)
    run_section(report, budget, "gptq", selected, plan.needs["gptq"],
                lambda: measure_gptq(report, budget, plan, device, model_dir, shape.vocab, work), no_model)
    run_section(report, budget, "gemv", selected, plan.needs["gemv"],
                lambda: measure_gemv(report, device, shape, facts["copy_bandwidth_gbs"] if facts else None))
    engine_variants(later, 0)  # each variant is skipped alone (with its row) when the budget is short
    if "profile" in selected:
        engine = report.section("engine")
        if report.rows("profile"):
            report.set("profile", status="ok", reason="measured with each variant's engine (section engine)")
        else:
            report.set("profile", status="skipped", reason=engine.get("reason") or engine.get("error")
                       or "no variant's engine was profiled (see skipped)")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the dry run: Triton kernels interpreted (set before import)

    def on_term(signum, frame) -> None:  # noqa: ANN001 - the device's timeout: unwind, so finally blocks run
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    (args.out / RESULTS_NAME).unlink(missing_ok=True)  # an interrupt must never mark an older run's file
    try:
        report = run(args, work)
    except KeyboardInterrupt:
        print("interrupted: the JSON holds every row measured so far", flush=True)
        path = args.out / RESULTS_NAME
        if path.is_file():  # the file always holds the last save (there is none before the first)
            data = json.loads(path.read_text())
            data["interrupted"] = True
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.work is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    print(table(report.data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
