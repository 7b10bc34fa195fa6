"""Speculative decoding through HTTP: batch-1 tokens/s with and without ``--speculative-tokens``.

Users meet speculation where they meet the server, so this measures it there: ``lifecycle serve``
processes on the same model with the same thread budget, one plain and one with n-gram speculation (or,
with ``--draft-model DIR``, three: two with that draft model, ``--speculative-model DIR`` as served by
default (the n-gram lookup's guesses where the context repeats and they promise more than the draft's) and
with ``--no-speculative-lookup`` (the draft's guesses alone), and one with n-gram lookup alone), driven
in turns by one streaming client at concurrency 1 (where speculation pays: a lone decode step reads every
weight for one token). Two workloads, greedy, ``ignore_eos``:

- **repeats its context**: a prompt P, the model's own greedy continuation C of P, then P again
  (``P C P``), as when a user asks to rewrite or quote a text: the reply after the second P largely
  re-reads what followed the first one;
- **fresh**: P alone, where there is little to look up (speculation must not cost anything there).

For each request every speculative server's reply is compared with the plain one's (they must be identical:
greedy output token for token), and tokens/s is completion tokens over the time from sending to the last
streamed token. The table gives medians over the prompts, the ratio speculative/plain, and the acceptance
rate from /metrics.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/speculative.py --model .lifecycle/models/base/ID
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/speculative.py --model BIG --draft-model SMALL

``--model`` is any Hugging Face model directory or bundle (default: the pretrained embedded ``micro`` base,
built first if missing); ``--draft-model`` a smaller model directory with the same tokenizer. Everything
the servers print goes to log files in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.servers import SERVED_NAME, BenchError, Child, free_port, launch, machine_facts, stop_all  # noqa: E402

SEEDS = ["The quick brown fox", "Once upon a time there was", "Hello, how are you", "The park was full of",
         "My favourite colour is", "Yesterday I went to", "The best way to learn is", "In the morning we"]


@dataclass
class Reply:
    text: str
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def stream_completion(url: str, prompt: str, max_tokens: int) -> Reply:
    import httpx

    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    tokens = 0
    started = time.perf_counter()
    last = started
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        if response.status_code != 200:
            raise BenchError(f"{url}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                parts.append(event["choices"][0].get("text", ""))
                last = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return Reply("".join(parts), tokens, last - started)


def scrape_acceptance(url: str) -> tuple[float, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
               for s in f.samples}
    return (samples.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
            samples.get("vllm:spec_decode_num_accepted_tokens_total", 0.0))


def start_server(children: list[Child], name: str, model: Path, threads: int, speculative_tokens: int, logs: Path,
                 flags: list[str] | None = None) -> str:
    """Our server with ``--speculative-tokens`` (0: plain) and ``flags``, started into ``children``; its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launch(children, name, [sys.executable, "-m", "serving.cli", "serve", str(model), "--port", str(port),
                            "--served-model-name", SERVED_NAME, "--threads", str(threads), "--log-level", "warning",
                            "--speculative-tokens", str(speculative_tokens), *(flags or [])], logs / f"{name}.log",
           dict(os.environ), url, timeout_s=300)
    return url


def default_model() -> Path:
    from training.base_model import BaseModelConfig, build_base_model

    return build_base_model(BaseModelConfig(preset="micro"))


def bench(args: argparse.Namespace, plain: str, specs: dict[str, str]) -> dict:
    """Per workload and speculative server: medians of tok/s against the plain server, prompt by prompt."""
    prompts = SEEDS[:args.prompts]
    for url in (plain, *specs.values()):  # warm-up: kernels, allocator
        stream_completion(url, "warm up", 8)
    workloads: dict[str, list[str]] = {"fresh": prompts}
    workloads["repeats its context"] = [p + stream_completion(plain, p, args.max_tokens).text + "\n" + p
                                        for p in prompts]
    results: dict[str, dict] = {}
    for name, texts in workloads.items():
        before = {label: scrape_acceptance(url) for label, url in specs.items()}
        rates: dict[str, list[float]] = {label: [] for label in ("plain", *specs)}
        identical = dict.fromkeys(specs, 0)
        for i, text in enumerate(texts):
            order = [("plain", plain), *specs.items()]
            order = order[i % len(order):] + order[:i % len(order)]  # rotate who goes first
            replies = {}
            for label, url in order:
                replies[label] = stream_completion(url, text, args.max_tokens)
                rates[label].append(replies[label].tokens_per_s)
            for label in specs:
                identical[label] += replies["plain"].text == replies[label].text
        for label, url in specs.items():
            drafted, accepted = (a - b for a, b in zip(scrape_acceptance(url), before[label]))
            results.setdefault(name, {})[label] = {
                "plain_tok_s": statistics.median(rates["plain"]), "spec_tok_s": statistics.median(rates[label]),
                "ratio": statistics.median(s / p for s, p in zip(rates[label], rates["plain"])),
                "acceptance": accepted / drafted if drafted else 0.0, "identical": f"{identical[label]}/{len(texts)}"}
    return results


def speculative_servers(args: argparse.Namespace) -> dict[str, list[str]]:
    """Label -> serve flags of each speculative server (beside the plain one)."""
    if args.draft_model is None:
        return {"n-gram lookup": []}
    draft = ["--speculative-model", str(args.draft_model)]
    return {"draft + lookup (default)": draft, "draft alone": [*draft, "--no-speculative-lookup"],
            "n-gram lookup alone": []}


def report(args: argparse.Namespace, model: Path, results: dict) -> str:
    draft = f" --speculative-model `{args.draft_model}`" if args.draft_model else ""
    lines = [f"model `{model}`, {args.threads} thread(s), --speculative-tokens {args.tokens}{draft}, "
             f"{args.prompts} prompts x {args.max_tokens} tokens, batch 1; {machine_facts()}", "",
             "| workload | guesses from | plain tok/s | speculative tok/s | × plain | acceptance | identical replies |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, by_server in results.items():
        for label, r in by_server.items():
            lines.append(f"| {name} | {label} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['ratio']:.2f} | "
                         f"{r['acceptance']:.2f} | {r['identical']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model or bundle dir (default: embedded micro)")
    parser.add_argument("--tokens", type=int, default=4, help="--speculative-tokens of the second server")
    parser.add_argument("--draft-model", type=Path, default=None,
                        help="the second server speculates with this draft model (--speculative-model) instead "
                             "of n-gram lookup: a smaller model dir with the same tokenizer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8, help=f"at most {len(SEEDS)}")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    try:
        model = args.model or default_model()
        for path in (model, args.draft_model):
            if path is not None and not (path / "config.json").is_file():
                raise BenchError(f"{path}: not a model directory (config.json missing)")
        with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
            children: list[Child] = []
            try:
                plain_url = start_server(children, "plain", model, args.threads, 0, Path(tmp))
                spec_urls = {}
                for i, (label, flags) in enumerate(speculative_servers(args).items()):
                    spec_urls[label] = start_server(children, f"speculative-{i}", model, args.threads, args.tokens,
                                                    Path(tmp), flags)
                results = bench(args, plain_url, spec_urls)
            finally:
                stop_all(children)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(args, model, results))
    if args.out:
        args.out.write_text(json.dumps({"model": str(model), "draft_model": str(args.draft_model or ""),
                                             "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
