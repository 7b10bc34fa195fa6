"""The gateway with an aiohttp trace on its upstream session, and the reading of that trace.

``benchmarks/gateway_share_bias.py`` starts the gateway through `run_traced_gateway` (in a child process) to see,
per upstream request, whether the gateway got a new connection or a pooled one, and when the request started,
had its connection and got the replica's response headers, on the client's clock.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path


def run_traced_gateway(config: str, trace_file: str) -> int:
    """The gateway as ``python -m serving.gateway.cli CONFIG`` runs it, plus an aiohttp trace on its upstream
    session (set up here, not in the gateway): one JSON line per upstream request with its X-Request-Id, whether
    it got a new connection or a pooled one, and perf_counter stamps (request start, connection in hand,
    response headers), on the clock the client's stamps use."""
    import aiohttp

    from serving.gateway.cli import main as gateway_main

    out = open(trace_file, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    async def start(session, ctx, params) -> None:
        ctx.t0, ctx.conn, ctx.t_conn = time.perf_counter(), "pooled", None
        ctx.rid, ctx.url, ctx.method = params.headers.get("x-request-id"), str(params.url), params.method

    async def created(session, ctx, params) -> None:
        ctx.conn = "new"

    async def got(session, ctx, params) -> None:
        ctx.t_conn = ctx.t_conn or time.perf_counter()

    async def end(session, ctx, params) -> None:
        out.write(json.dumps({"rid": ctx.rid, "url": ctx.url, "method": ctx.method, "conn": ctx.conn, "t0": ctx.t0,
                              "t_conn": ctx.t_conn, "t_headers": time.perf_counter()}) + "\n")

    async def failed(session, ctx, params) -> None:
        out.write(json.dumps({"rid": ctx.rid, "url": ctx.url, "method": ctx.method, "conn": ctx.conn, "t0": ctx.t0,
                              "error": f"{type(params.exception).__name__}: {params.exception}"[:200]}) + "\n")

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(start)
    trace.on_connection_create_end.append(created)
    trace.on_connection_create_end.append(got)
    trace.on_connection_reuseconn.append(got)
    trace.on_request_end.append(end)
    trace.on_request_exception.append(failed)
    init = aiohttp.ClientSession.__init__

    def traced_init(self, *a, **kw) -> None:
        init(self, *a, **{**kw, "trace_configs": [*(kw.get("trace_configs") or []), trace]})

    aiohttp.ClientSession.__init__ = traced_init
    return gateway_main([config])


def read_trace(path: Path) -> tuple[dict[str, dict], dict[str, int]]:
    """Upstream POSTs by request id (the last attempt), and connections the gateway opened per replica URL
    (its health checks' included)."""
    posts, opened = {}, defaultdict(int)
    for line in path.read_text().splitlines() if path.is_file() else []:
        t = json.loads(line)
        base = t["url"].split("/v1/")[0].split("/ready")[0]
        opened[base] += t["conn"] == "new"
        if t["method"] == "POST" and t["rid"]:
            posts[t["rid"]] = t
    return posts, opened
