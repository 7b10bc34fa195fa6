"""Serving a 4-bit snapshot through HTTP: the fast path (dequantized once) vs gptqmodel's HF path vs fp32.

The default recipe ships the GPTQ bundle, so its serving speed is what users get. Three ``lifecycle serve``
processes, one after another, same thread budget: the fp bundle, the 4-bit bundle with ``--model-impl hf``
(gptqmodel's CPU kernels), and the 4-bit bundle on the default path (the compact forward on its
dequantized weights). Each gets the same held-out chat prompts as non-streaming ``/v1/completions``
(greedy, ``--max-tokens`` with ``ignore_eos``) at concurrency 16 and at 1; the table gives output tok/s and
the ratio to fp. The 4-bit replies of both paths are compared token for token.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/quantized_serving.py \\
        --fp BUNDLE_FP --quantized BUNDLE_GPTQ --prompts DATA_DIR/tasks_heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

from benchmarks.gateway import SERVED_NAME, BenchError, Child, free_port, machine_facts, wait_ready  # noqa: E402


def chat_prompts(model: Path, path: Path, n: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                          add_generation_prompt=True) for r in rows]


def complete(url: str, prompt: str, max_tokens: int) -> list[str]:
    import httpx

    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    if response.status_code != 200:
        raise BenchError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["choices"][0]["logprobs"]["tokens"]


def measure(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[float, list[list[str]]]:
    complete(url, prompts[0], 4)  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda p: complete(url, p, max_tokens), prompts))
    return sum(map(len, replies)) / (time.perf_counter() - started), replies


def serve(name: str, model: Path, threads: int, impl: str, logs: Path) -> tuple[Child, str]:
    import os

    port = free_port()
    child = Child(name, [sys.executable, "-m", "serving.cli", "serve", str(model), "--port", str(port),
                         "--served-model-name", SERVED_NAME, "--threads", str(threads), "--log-level", "warning",
                         "--model-impl", impl], logs / f"{name}.log", dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_ready(child, url, timeout_s=300)
    return child, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp", type=Path, required=True, help="the full-precision bundle or model dir")
    parser.add_argument("--quantized", type=Path, required=True, help="the GPTQ or AWQ bundle of the same model")
    parser.add_argument("--prompts", type=Path, required=True, help="a tasks_heldout.jsonl of the data stage")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    systems = [("fp32 bundle", args.fp, "auto"), ("4-bit, HF path (gptqmodel kernels)", args.quantized, "hf"),
               ("4-bit, fast path (dequantized)", args.quantized, "auto")]
    try:
        prompts = chat_prompts(args.fp, args.prompts, args.requests)
        results: dict[str, dict] = {}
        with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
            for name, model, impl in systems:
                child, url = serve(name.split(",")[0].replace(" ", "-"), model, args.threads, impl, Path(tmp))
                try:
                    results[name] = {f"c{c}": measure(url, prompts if c > 1 else prompts[:12], args.max_tokens, c)
                                     for c in (16, 1)}
                finally:
                    child.terminate()
                    child.stop()
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fp = results["fp32 bundle"]
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.threads} threads; {machine_facts()}\n")
    print("| server | tok/s at 16 concurrent | × fp32 | tok/s at batch 1 | × fp32 |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['c16'][0]:.0f} | {r['c16'][0] / fp['c16'][0]:.2f} | {r['c1'][0]:.0f} | "
              f"{r['c1'][0] / fp['c1'][0]:.2f} |")
    hf, fast = (results[name]["c16"][1] for name, _, _ in systems[1:])
    same = sum(a == b for x, y in zip(hf, fast) for a, b in zip(x, y))
    print(f"\n4-bit replies, fast path vs HF path: {sum(a == b for a, b in zip(hf, fast))}/{len(hf)} identical, "
          f"{same}/{sum(map(len, hf))} tokens agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
