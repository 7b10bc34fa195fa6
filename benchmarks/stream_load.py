"""The streaming client the HTTP benchmarks share: seeded request shapes, fresh token-id prompts, closed-loop
``/v1/completions`` streams with each token's arrival time, and their summary (tok/s, TTFT, ITL).

Figures are as the client sees them: output tok/s is completion tokens over the time to the last token, TTFT
runs from sending the request to the first streamed token, ITL between streamed token events.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from artifacts.common.stats import percentile
from benchmarks.servers import SERVED_NAME, BenchError

FIRST_NORMAL_TOKEN = 7  # ids below are special tokens in the bench tokenizer


@dataclass
class Shape:
    prompt_len: int
    max_tokens: int


def check_ranges(ap, args, names: tuple[str, ...] = ("prompt_range", "output_range")) -> None:
    """Each ``--*-range MIN MAX`` flag must have 1 <= MIN <= MAX (``ap.error`` otherwise)."""
    for name in names:
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            ap.error(f"--{name.replace('_', '-')}: want 1 <= MIN <= MAX, got {lo} {hi}")


def make_shapes(n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]) -> list[Shape]:
    rng = random.Random(seed)
    return [Shape(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(n)]


def make_prompts(shapes: list[Shape], vocab: int, seed: int) -> list[list[int]]:
    """Fresh token ids for every run (same lengths), so no run reuses another's cached prefix blocks."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_NORMAL_TOKEN, vocab) for _ in range(s.prompt_len)] for s in shapes]


@dataclass
class Stream:
    sent: float
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int | None = None


async def one_stream(client, url: str, headers: dict[str, str], prompt: list[int], max_tokens: int,
                     t0: float, model: str = SERVED_NAME) -> Stream:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out = Stream(sent=time.perf_counter() - t0)
    try:
        return await read_stream(client, url, headers, body, out, t0)
    except httpx.TransportError as exc:  # the server closed or reset the stream: name it, no traceback
        raise BenchError(f"{url}: stream lost after {len(out.token_times)} tokens "
                         f"({type(exc).__name__}: {exc or 'connection closed'})") from exc


async def read_stream(client, url: str, headers: dict[str, str], body: dict, out: Stream, t0: float) -> Stream:
    """POST ``body`` as a stream and stamp each event that carries a choice into ``out`` (seconds since t0)."""
    import orjson

    async with client.stream("POST", url + "/v1/completions", content=orjson.dumps(body),
                             headers={"content-type": "application/json", **headers}) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise BenchError(f"{url}: HTTP {resp.status_code}: {text[:300]}")
        buf = b""
        async for chunk in resp.aiter_raw():
            now = time.perf_counter() - t0
            buf += chunk
            while (cut := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:cut], buf[cut + 2:]
                if not event.startswith(b"data:"):
                    continue
                payload = event[5:].strip()
                if payload == b"[DONE]":
                    continue
                obj = orjson.loads(payload)
                if "error" in obj:
                    raise BenchError(f"{url}: error event: {obj['error']}")
                if obj.get("choices"):
                    out.token_times.append(now)
                if obj.get("usage"):
                    out.completion_tokens = obj["usage"].get("completion_tokens")
    return out


async def run_load(client, url: str, headers: dict[str, str], prompts: list[list[int]], shapes: list[Shape],
                   concurrency: int, models: list[str] | None = None) -> list[Stream]:
    """``models``: the ``model`` of each request (a LoRA adapter's name, say); default the served name."""
    order = iter(range(len(shapes)))
    results: list[Stream | None] = [None] * len(shapes)
    t0 = time.perf_counter()

    async def worker() -> None:
        for i in order:
            model = models[i] if models is not None else SERVED_NAME
            results[i] = await one_stream(client, url, headers, prompts[i], shapes[i].max_tokens, t0, model)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


def summarize(streams: list[Stream], shapes: list[Shape]) -> dict[str, float]:
    ttft, itl, e2e = [], [], []
    tokens = 0
    for s, shape in zip(streams, shapes):
        n = s.completion_tokens if s.completion_tokens is not None else len(s.token_times)
        if n != shape.max_tokens or not s.token_times:
            raise BenchError(f"a stream returned {n} tokens, expected {shape.max_tokens} (ignore_eos)")
        tokens += n
        ttft.append(s.token_times[0] - s.sent)
        e2e.append(s.token_times[-1] - s.sent)
        itl.extend(b - a for a, b in zip(s.token_times, s.token_times[1:]))
    end = max(s.token_times[-1] for s in streams)
    return {"output_tok_s": tokens / end, "wall_s": end, "ttft_p50_ms": percentile(ttft, 50) * 1e3,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3, "itl_p50_ms": percentile(itl, 50) * 1e3,
            "itl_p99_ms": percentile(itl, 99) * 1e3, "e2e_p50_ms": percentile(e2e, 50) * 1e3, "tokens": tokens}


async def scrape(client, url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of every sample of each named metric (over all label sets) in a Prometheus text page."""
    text = (await client.get(url + "/metrics", timeout=10)).text
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in names:
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out
