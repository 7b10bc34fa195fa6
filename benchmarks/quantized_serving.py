"""Serving a 4-bit snapshot through HTTP: from its 4-bit codes, from fp32 copies, through gptqmodel, against fp32.

The default recipe ships the GPTQ bundle, so its serving speed and memory are what users get. Four ``lifecycle
serve`` processes on the same thread budget, all started at once (an idle one waits on its socket):

- the fp32 model;
- the 4-bit snapshot on the default path: the compact forward on its 4-bit codes (``serving.engine.int4_linear``);
- the same with ``--dequantize``: the compact forward on fp32 copies of the dequantized weights (the old path);
- the same with ``--model-impl hf``: the Hugging Face forward through gptqmodel's CPU kernels.

Each level (16 concurrent requests, then batch 1) runs ``--rounds`` times with the servers taking turns, the
order rotating, and the table gives medians: output tok/s and its ratio to fp32, batch-1 ms per token against
the fp32 model's decode floor (the bytes one step reads, every weight but the embedding, over the machine's
read bandwidth, the best of a measurement before and after the run), and the MB of weights each engine holds.
The 4-bit replies of the three 4-bit servers are compared token for token.

    .venv/bin/python benchmarks/quantized_serving.py --model bench          # the bench Llama and its GPTQ build
    .venv/bin/python benchmarks/quantized_serving.py --fp BUNDLE_FP --quantized BUNDLE_GPTQ \\
        --prompts DATA_DIR/tasks_heldout.jsonl                              # a pipeline's bundles, chat prompts

Without ``--prompts`` the requests are seeded random token ids (``/v1/completions`` with a token-id prompt).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.servers import SERVED_NAME, BenchError, free_port, launch, machine_facts, stop_all  # noqa: E402
from benchmarks.stream_load import FIRST_NORMAL_TOKEN  # noqa: E402

Prompt = str | list[int]


def chat_prompts(model: Path, path: Path, n: int) -> list[Prompt]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                          add_generation_prompt=True) for r in rows]


def token_prompts(model: Path, n: int, seed: int = 0) -> list[Prompt]:
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_NORMAL_TOKEN, vocab) for _ in range(rng.randint(32, 128))] for _ in range(n)]


def complete(url: str, prompt: Prompt, max_tokens: int) -> list[str]:
    import httpx

    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    if response.status_code != 200:
        raise BenchError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["choices"][0]["logprobs"]["tokens"]


def measure(url: str, prompts: list[Prompt], max_tokens: int, concurrency: int) -> tuple[float, list[list[str]]]:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda p: complete(url, p, max_tokens), prompts))
    return sum(map(len, replies)) / (time.perf_counter() - started), replies


def weight_mb(model: Path, flags: list[str]) -> float:
    """MB of weights the engine holds for ``model`` served with ``flags`` (loaded here once, no KV cache)."""
    from serving.engine import EngineConfig
    from serving.engine.model_runner import ModelRunner

    config = EngineConfig(num_blocks=1, dequantize="--dequantize" in flags,
                          model_impl="hf" if "hf" in flags else "auto")
    runner = ModelRunner(model, config)
    if runner.compact is not None:
        return runner.compact.weight_bytes / 1e6
    tensors = [*runner.model.parameters(), *runner.model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def decode_bytes(model: Path) -> int:
    """Bytes one decode step reads from a full-precision checkpoint: every tensor but the input embedding
    (only one row of it is gathered per token), the lm_head included even when it is tied."""
    from benchmarks.bench_model import tensor_bytes

    sizes = tensor_bytes(model)
    if json.loads((model / "config.json").read_text()).get("tie_word_embeddings", False):
        return sum(sizes.values())
    return sum(n for name, n in sizes.items() if not name.endswith("embed_tokens.weight"))


def check_model_dir(flag: str, path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise BenchError(f"{flag}: {path}: not a Hugging Face model directory (config.json missing)")
    return path


SYSTEMS = ("fp32 model", "4-bit codes (default)", "4-bit, fp32 copies (--dequantize)",
           "4-bit, HF path (gptqmodel kernels)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="'bench': the bench Llama and its GPTQ build (made once)")
    parser.add_argument("--fp", type=Path, help="the full-precision bundle or model dir")
    parser.add_argument("--quantized", type=Path, help="the GPTQ or AWQ bundle of the same model")
    parser.add_argument("--prompts", type=Path, help="a tasks_heldout.jsonl of the data stage (chat prompts)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


def check_args(args: argparse.Namespace) -> None:
    """Resolve ``--model bench`` (building the models once) and refuse what cannot run, as a BenchError."""
    if args.model == "bench":
        from benchmarks.bench_model import build_bench_model, build_quantized_bench_model

        args.fp, args.quantized = build_bench_model(), build_quantized_bench_model("gptq")
    elif args.model is not None or args.fp is None or args.quantized is None:
        raise BenchError("give --model bench, or both --fp and --quantized")
    check_model_dir("--fp", args.fp)
    check_model_dir("--quantized", args.quantized)
    if args.prompts is not None and not args.prompts.is_file():
        raise BenchError(f"--prompts: {args.prompts}: no such file")
    if args.rounds < 1 or args.requests < 1 or args.max_tokens < 1:
        raise BenchError("--rounds, --requests and --max-tokens must be at least 1")


def run(args: argparse.Namespace, systems: dict[str, tuple[Path, list[str]]],
        prompts: list[Prompt]) -> tuple[dict[str, dict[str, list]], dict[str, list[list[str]]]]:
    """Every server started at once, then each level ``--rounds`` times in rotating turns: tok/s per system and
    level, and each system's first replies."""
    results: dict[str, dict[str, list]] = {name: {"c16": [], "c1": []} for name in systems}
    replies: dict[str, list[list[str]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        children, urls = [], {}
        try:
            for i, (name, (model, flags)) in enumerate(systems.items()):
                port = free_port()
                urls[name] = f"http://127.0.0.1:{port}"
                launch(children, f"server{i}", [
                    sys.executable, "-m", "serving.cli", "serve", str(model), "--port", str(port),
                    "--served-model-name", SERVED_NAME, "--threads", str(args.threads), "--log-level",
                    "warning", *flags], Path(tmp) / f"server{i}.log", None, urls[name], timeout_s=300)
                complete(urls[name], prompts[0], 4)  # warm-up
            names = list(systems)
            for level, (conc, batch) in {"c16": (16, prompts), "c1": (1, prompts[:8])}.items():
                for r in range(args.rounds):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        tok_s, out = measure(urls[name], batch, args.max_tokens, conc)
                        results[name][level].append(tok_s)
                        replies.setdefault(name, out)
                        print(f"  {level} round {r + 1}: {name}: {tok_s:.0f} tok/s", flush=True)
        finally:
            stop_all(children)
    return results, replies


def report(args: argparse.Namespace, results: dict[str, dict[str, list]], replies: dict[str, list[list[str]]],
           memory: dict[str, float], bandwidth: float) -> None:
    med = {name: {level: statistics.median(v) for level, v in r.items()} for name, r in results.items()}
    fp = med["fp32 model"]
    floor_ms = decode_bytes(args.fp) / bandwidth * 1e3
    print(f"\n{args.requests} requests x {args.max_tokens} tokens (8 at batch 1), {args.threads} threads, "
          f"{args.rounds} rounds in turns, medians; read bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 decode floor "
          f"{floor_ms:.2f} ms/token; {machine_facts()}\n")
    print("| server | tok/s at 16 concurrent | × fp32 | tok/s at batch 1 | ms/token | × fp32 floor | weights MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, m in med.items():
        ms = 1e3 / m["c1"]
        print(f"| {name} | {m['c16']:.0f} | {m['c16'] / fp['c16']:.2f} | {m['c1']:.0f} | {ms:.2f} | "
              f"{ms / floor_ms:.2f} | {memory.get(name, 0):.0f} |")
    codes = replies["4-bit codes (default)"]
    for other in ("4-bit, fp32 copies (--dequantize)", "4-bit, HF path (gptqmodel kernels)"):
        same = sum(a == b for x, y in zip(codes, replies[other]) for a, b in zip(x, y))
        print(f"\n4-bit codes vs {other}: {sum(a == b for a, b in zip(codes, replies[other]))}/{len(codes)} replies "
              f"identical, {same}/{sum(map(len, codes))} tokens agree", end="")
    print()


def main() -> int:
    args = parse_args()
    try:
        check_args(args)
        from benchmarks.bandwidth import measure_read_bandwidth

        bandwidth = measure_read_bandwidth(threads=args.threads)
        prompts = chat_prompts(args.fp, args.prompts, args.requests) if args.prompts \
            else token_prompts(args.fp, args.requests)
        serve_flags = ([], [], ["--dequantize"], ["--model-impl", "hf"])
        systems = {name: (args.fp if name == "fp32 model" else args.quantized, flags)
                   for name, flags in zip(SYSTEMS, serve_flags)}
        memory = {name: weight_mb(model, flags) for name, (model, flags) in systems.items()}
        import logging

        logging.getLogger("httpx").setLevel(logging.WARNING)  # gptqmodel's import turned request logging on
        results, replies = run(args, systems, prompts)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bandwidth = max(bandwidth, measure_read_bandwidth(threads=args.threads))
    report(args, results, replies, memory, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
