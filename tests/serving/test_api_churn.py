"""Churn: a thousand streams dropped mid-way leave nothing behind (sequences, KV blocks, threads, sockets).

The server runs in this process (uvicorn in a thread), so /proc/self/fd and the thread count are the
server's, plus the test client's, which is closed before counting.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import httpx
import pytest

from serving.engine import EngineConfig
from tests.serving.test_api_server import MODEL, running_server, server_log

STREAMS = 1000
CONCURRENCY = 32


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def drop_streams(base: str, count: int, concurrency: int) -> dict[str, int]:
    """`count` completion streams, `concurrency` at a time, each dropped after its first token."""
    sem = asyncio.Semaphore(concurrency)
    seen = {"dropped": 0, "finished": 0}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "stream": True}

    async def one(c: httpx.AsyncClient, i: int) -> None:
        async with sem:
            # a chat stream now and then: both handlers must let go of what they hold
            path, payload = ("/v1/completions", body) if i % 4 else (
                "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 48, "ignore_eos": True, "stream": True})
            async with c.stream("POST", base + path, json=payload) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        seen["finished"] += 1
                        return
                    chunks += line.startswith("data:")
                    if chunks >= 3:  # the role chunk or first text, then a token or two: mid-answer
                        seen["dropped"] += 1
                        return  # leaving the block closes the connection

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        await asyncio.gather(*[one(c, i) for i in range(count)])
    return seen


def settle(engine, deadline_s: float = 30) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0:
            return
        assert time.monotonic() < deadline, f"left behind: {s}"
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_thousand_dropped_streams_leave_no_requests_blocks_threads_or_fds(tiny_model_dir):
    cfg = EngineConfig(num_blocks=512, block_size=8, max_num_seqs=CONCURRENCY, max_queue=4 * CONCURRENCY)
    with running_server(tiny_model_dir, cfg) as (base, engine):
        asyncio.run(drop_streams(base, 2 * CONCURRENCY, CONCURRENCY))  # warm every lazily started pool
        settle(engine)
        time.sleep(0.5)
        fds, threads = open_fds(), threading.active_count()
        finished_before = engine.stats().requests_finished_total
        start = time.monotonic()
        with server_log("uvicorn.error", "serving") as records:
            seen = asyncio.run(drop_streams(base, STREAMS, CONCURRENCY))
            settle(engine)
        took = time.monotonic() - start
        time.sleep(0.5)  # sockets the server closed on its side are released on the next loop turn
        assert seen["dropped"] + seen["finished"] == STREAMS and seen["dropped"] >= 0.9 * STREAMS, seen
        assert engine.stats().requests_finished_total - finished_before == STREAMS  # each one ended, none leaked
        assert engine.stats().num_free_blocks == engine.stats().num_blocks
        assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]
        assert open_fds() <= fds, sorted(os.listdir("/proc/self/fd"))
        errors = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
        assert not errors, errors[:3]
        assert httpx.get(f"{base}/health").status_code == 200
        print(f"churn: {STREAMS} streams at concurrency {CONCURRENCY} in {took:.1f}s; {seen}")
