"""Per-token host work outside the model: detokenization and the outputs sent over the engine-core pipe.

Two figures, no model needed (the tokenizer is the pipeline's own, trained here in a second, or --tokenizer):

- detokenization tokens/s: the Python window (two ``tokenizer.decode`` calls per token, the fallback) against
  ``tokenizers``' ``DecodeStream`` (one Rust step per token), over a few thousand tokens of mixed text;
- the bytes pickled per step over the pipe at --seqs sequences x --tokens output tokens with --logprobs: the
  full ``RequestOutput``s the core used to send against the ``RequestDelta``s it sends now, with the time to
  pickle and unpickle them, and what building and assembling the deltas costs each side.

    .venv/bin/python benchmarks/engine_outputs.py --seqs 64 --tokens 500 --logprobs 5
"""

from __future__ import annotations

import argparse
import pickle
import random
import time

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from serving.engine.core_process import CoreStep  # noqa: E402
from serving.engine.detokenizer import IncrementalDetokenizer, StreamDecoder, WindowDecoder, make_decoder  # noqa: E402
from serving.engine.output_deltas import DeltaEncoder, OutputAssembler, RequestDelta  # noqa: E402
from serving.engine.outputs import EngineStats, request_output  # noqa: E402
from serving.engine.sampling_params import SamplingParams  # noqa: E402
from serving.engine.sequence import Sequence  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. Grüße aus München — ça va? naïve café. "
        "日本語のテキストと中文文本 🙂🚀 def add(a, b): return a + b\n")


def load_tokenizer(path: str | None):
    if path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from training.tokenizer import train_tokenizer

    return train_tokenizer([TEXT] * 20, vocab_size=400)


def best_seconds(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def detokenize(tok, num_tokens: int, rounds: int) -> None:
    ids = (tok.encode(TEXT) * (num_tokens // len(tok.encode(TEXT)) + 1))[:num_tokens]
    assert isinstance(make_decoder(tok, [], True), StreamDecoder), "not a fast tokenizer: nothing to compare"
    window_s = best_seconds(lambda: [d.step(t) for d in [WindowDecoder(tok, [], True)] for t in ids], rounds)
    stream_s = best_seconds(lambda: [d.step(t) for d in [make_decoder(tok, [], True)] for t in ids], rounds)
    print(f"detokenize {len(ids)} tokens: window (2 decodes/token) {len(ids) / window_s:,.0f} tok/s "
          f"({window_s / len(ids) * 1e6:.2f} us/token); DecodeStream {len(ids) / stream_s:,.0f} tok/s "
          f"({stream_s / len(ids) * 1e6:.2f} us/token); {window_s / stream_s:.1f}x")


def busy_sequences(tok, seqs: int, tokens: int, logprobs: int, prompt_len: int) -> list[Sequence]:
    """``seqs`` sequences ``tokens`` tokens into their answers, with text and logprob records, as the
    scheduler leaves them before it builds their outputs."""
    rng = random.Random(0)
    answer = (tok.encode(TEXT) * (tokens // len(tok.encode(TEXT)) + 1))[:tokens]
    params = SamplingParams(max_tokens=tokens + 100, logprobs=logprobs)
    out = []
    for i in range(seqs):
        prompt = [rng.randrange(10, len(tok)) for _ in range(prompt_len)]
        seq = Sequence(f"req-{i}", prompt, params)
        seq.detokenizer = IncrementalDetokenizer(tok, prompt)
        for t in answer:
            seq.token_ids.append(t)
            seq.detokenizer.add_token(t)
            seq.logprobs.append({t: -rng.random(), **{rng.randrange(len(tok)): -5 * rng.random()
                                                       for _ in range(logprobs)}})
        seq.detokenizer.delta(False)
        seq.first_token_time = time.monotonic()
        out.append(seq)
    return out


def pipe_bytes(tok, seqs: int, tokens: int, logprobs: int, prompt_len: int, rounds: int) -> None:
    batch = busy_sequences(tok, seqs, tokens, logprobs, prompt_len)
    stats = EngineStats(*([0] * 13))
    outputs = [request_output(s, [s.token_ids[-1]], [s.logprobs[-1]], finished=False) for s in batch]
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    for s, o in zip(batch, outputs, strict=True):  # the API side has the answers so far, less this step's token
        assembler.add(s.request_id, s.prompt_token_ids, s.params, s.arrival_time)
        assembler.assemble(RequestDelta(s.request_id, s.output_token_ids[:-1], o.text[:-len(o.delta_text) or None],
                                        s.logprobs[:-1], False))
    deltas = [encoder.encode(o) for o in outputs]
    full_msg, delta_msg = pickle.dumps(CoreStep(outputs, stats)), pickle.dumps(CoreStep(deltas, stats))
    full_s = best_seconds(lambda: pickle.loads(pickle.dumps(CoreStep(outputs, stats))), rounds)
    delta_s = best_seconds(lambda: pickle.loads(pickle.dumps(CoreStep(deltas, stats))), rounds)
    encode_s = best_seconds(lambda: [encoder.encode(o) for o in outputs], rounds)
    assemble_s = best_seconds(lambda: [assembler.assemble(d) for d in deltas], 1)  # it grows the texts
    print(f"one step, {seqs} seqs x {tokens} tokens, logprobs={logprobs}, prompts of {prompt_len}: "
          f"full outputs {len(full_msg):,} bytes, pickle+unpickle {full_s * 1e3:.2f} ms; "
          f"deltas {len(delta_msg):,} bytes, {delta_s * 1e3:.3f} ms ({len(full_msg) / len(delta_msg):.0f}x fewer "
          f"bytes); encode {encode_s / seqs * 1e6:.2f} us/seq (core), assemble {assemble_s / seqs * 1e6:.2f} "
          f"us/seq (API)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", help="a model or tokenizer directory (default: the pipeline's tokenizer)")
    ap.add_argument("--detok-tokens", type=int, default=4000)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer)
    detokenize(tok, args.detok_tokens, args.rounds)
    pipe_bytes(tok, args.seqs, args.tokens, args.logprobs, args.prompt_len, args.rounds)


if __name__ == "__main__":
    main()
