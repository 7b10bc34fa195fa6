"""xgrammar or llguidance for constrained decoding? Both measured on our own tokenizers, on the same schemas.

For each library and tokenizer, over N random schemas (``benchmarks/random_schemas.py``): the time to compile a
schema into a grammar (the engine does it off its loop, once per schema, but a new schema waits for it), the
time to fill one row's token mask per decode step (paid on the engine loop, every step, for every constrained
row), and a check the engine cannot do without: a random walk that picks any token the mask allows (the worst
model there is) must end in JSON that parses and validates. Run:

    .venv/bin/python benchmarks/grammar_libraries.py [--schemas 100] [--tokenizer DIR ...]

Default tokenizers: the embedded base's (280 tokens, digits split) and the bench model's (byte-level BPE, 8k).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.random_schemas import random_schemas  # noqa: E402

MAX_WALK_TOKENS = 400


@dataclass
class LibraryRun:
    compile_ms: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)
    walks: int = 0
    finished: int = 0
    valid: int = 0
    errors: list[str] = field(default_factory=list)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def matcher(self, schema: dict) -> Any:
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))

    def bitmask(self) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher: Any) -> bool:
        return matcher.is_terminated()


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def matcher(self, schema: dict) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults={"whitespace_flexible": False})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def bitmask(self) -> torch.Tensor:
        return self.ll.torch.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self.ll.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher: Any) -> bool:
        return matcher.is_stopped()


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    words = bitmask[0].to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, None] >> torch.arange(32)) & 1
    return [t for t in bits.flatten().nonzero().flatten().tolist() if t < vocab_size]


def walk(lib: Any, schema: dict, tokenizer: Any, eos: int, rng: random.Random, run: LibraryRun) -> None:
    """Compile, then take random allowed tokens (EOS with probability 0.3 when allowed) until the matcher stops."""
    from jsonschema import Draft202012Validator

    started = time.perf_counter()
    matcher = lib.matcher(schema)
    run.compile_ms.append((time.perf_counter() - started) * 1e3)
    bitmask = lib.bitmask()
    tokens: list[int] = []
    run.walks += 1
    for _ in range(MAX_WALK_TOKENS):
        started = time.perf_counter()
        lib.fill(matcher, bitmask)
        run.mask_us.append((time.perf_counter() - started) * 1e6)
        allowed = allowed_tokens(bitmask, lib.vocab_size)
        if not allowed:
            run.errors.append(f"empty mask after {tokenizer.decode(tokens)!r}")
            return
        token = eos if eos in allowed and rng.random() < 0.3 else rng.choice(allowed)
        if not lib.accept(matcher, token):
            run.errors.append(f"{lib.name} refused its own allowed token {token}")
            return
        if token == eos:
            break
        tokens.append(token)
        if lib.done(matcher):
            break
    else:
        return  # cut by the walk's length: counted as not finished
    run.finished += 1
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    try:
        Draft202012Validator(schema).validate(json.loads(text))
        run.valid += 1
    except Exception as exc:  # noqa: BLE001 - any parse or validation failure is this row's finding
        run.errors.append(f"{type(exc).__name__}: {str(exc)[:80]} in {text[:80]!r}")


def measure(make: Callable[[Any, int], Any], tokenizer_dir: Path, schemas: list[dict], seed: int) -> LibraryRun:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab_size = len(tokenizer)
    lib = make(tokenizer, vocab_size)
    run = LibraryRun()
    rng = random.Random(seed)
    for schema in schemas:
        walk(lib, schema, tokenizer, tokenizer.eos_token_id, rng, run)
    return run


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, action="append", help="an HF tokenizer dir (repeatable)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for path in args.tokenizer or []:
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            parser.error(f"--tokenizer: {path} is not a Hugging Face tokenizer dir (no tokenizer.json)")
    if args.tokenizer:
        tokenizers = args.tokenizer
    else:
        from benchmarks.bench_model import build_bench_model

        tokenizers = [Path(__file__).resolve().parent.parent / "training" / "embedded_base", build_bench_model()]
    schemas = random_schemas(args.schemas, args.seed)
    print(f"{args.schemas} random schemas (seed {args.seed}); mask = one row's fill per step; walk = random allowed "
          f"tokens, EOS at 0.3 when allowed, cut at {MAX_WALK_TOKENS}\n")
    print("| tokenizer | library | compile p50 ms | compile p95 ms | mask p50 µs | mask p95 µs | walks finished | "
          "valid of finished | errors |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for tokenizer_dir in tokenizers:
        for make in (Xgrammar, Llguidance):
            run = measure(make, tokenizer_dir, schemas, args.seed)
            print(f"| {tokenizer_dir.name} | {make.name} | {_pct(run.compile_ms, 50):.2f} | "
                  f"{_pct(run.compile_ms, 95):.2f} | {_pct(run.mask_us, 50):.0f} | {_pct(run.mask_us, 95):.0f} | "
                  f"{run.finished}/{run.walks} | {run.valid}/{run.finished} | {len(run.errors)} |", flush=True)
            for error in run.errors[:3]:
                print(f"  {make.name}: {error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
