"""Gateway defects, each shown on the real thing: the gateway app on 127.0.0.1 (in a thread, or as the
`lifecycle gateway` process), in front of our engine server or, where a fault must be injected on purpose, a
tiny HTTP upstream that answers it every time.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from serving.gateway.token_cost import estimate_prompt_tokens
from tests.serving.fleet_support import bearer, engine_thread, free_port, gateway_process, uvicorn_thread, wait_ready
from tests.serving.test_gateway import MODEL, complete, gateway


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    with engine_thread(tiny_model_dir, "tiny-a") as base:
        yield base


def _chat(base: str, secret: str | None, messages: list) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", headers=bearer(secret) if secret else {}, timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0})


# ----------------------------------------------------------------------------- malformed content parts
@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}, "x", 7]}]},
    {"messages": {"role": "user"}}, {"messages": 5}, {"messages": [5, None, "x", [1]]},
    {"messages": [{"content": 3.5}, {"content": [None, [], {"text": None}]}]},
    {"prompt": [None, 1.5, {"a": 1}, [1, 2], "abc", True]}, {"prompt": 7}, {"prompt": None, "messages": None},
])
def test_the_prompt_estimate_never_raises(body):
    assert estimate_prompt_tokens(body) >= 1


def test_a_non_string_text_part_is_a_400_naming_the_field(tmp_path, replica, caplog):
    """`text: 123` in a chat content part was a plain-text 500 with a traceback (the token estimate raised);
    our server answers it 400, and so does the gateway now, in OpenAI's error shape, before any replica."""
    with gateway(tmp_path, [replica]) as (base, user, admin, _):
        bad = _chat(base, user, [{"role": "user", "content": [{"type": "text", "text": 123}]}])
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == "messages.0.content.0.text" and error["type"] == "invalid_request_error"
        assert "messages.0.content.0.text" in error["message"] and "string" in error["message"]
        missing = _chat(base, user, [{"role": "user", "content": "hi"},
                                     {"role": "user", "content": [{"type": "image_url"}, {"type": "text"}]}])
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages.1.content.1.text"
        shape = httpx.post(f"{base}/v1/completions", headers=bearer(user), timeout=60,
                           json={"model": MODEL, "prompt": "hi", "stream": True, "stream_options": [1]})
        assert shape.status_code == 400 and shape.json()["error"]["param"] == "stream_options"
        good = _chat(base, user, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
        assert good.status_code == 200 and good.json()["choices"][0]["message"]["role"] == "assistant"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a traceback was logged"


# ----------------------------------------------------------------------------- what can never succeed is a 400
_PROMPTS = {"/v1/chat/completions": ("messages", lambda text: [{"role": "user", "content": text}]),
            "/v1/completions": ("prompt", lambda text: text)}


def _ask(base: str, secret: str, path: str, text: str = "hi", **fields) -> httpx.Response:
    name, shape = _PROMPTS[path]
    return httpx.post(f"{base}{path}", headers=bearer(secret), timeout=60,
                      json={"model": MODEL, name: shape(text), "temperature": 0, **fields})


def _known_context(gw) -> int:
    """The context the gateway has read from its replicas' /v1/models (it polls them as it starts)."""
    deadline = time.monotonic() + 30
    while gw.pools.largest_context() is None:
        assert time.monotonic() < deadline, "the gateway never learned its replicas' context length"
        time.sleep(0.05)
    return gw.pools.largest_context()


@pytest.mark.parametrize("path", list(_PROMPTS))
def test_a_request_that_can_never_fit_is_a_400_not_a_429(tmp_path, replica, path):
    """`max_tokens: 1e9` on chat was a 429 "token rate limit ... retry in 53 s", and a retry never helps. Over
    the context, or over the key's whole token budget, is a 400 saying why on chat and completions alike,
    and it spends none of the budget: nor does a request the replica refuses."""
    with gateway(tmp_path, [replica], limits={"rpm": 1e6, "tpm": 1000}) as (base, user, _, gw):
        context = _known_context(gw)
        for field, value in (("max_tokens", 10 ** 9), ("max_tokens", 1e9), ("max_completion_tokens", context)):
            if field == "max_completion_tokens" and path == "/v1/completions":
                field = "max_tokens"
            r = _ask(base, user, path, **{field: value})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field and error["type"] == "invalid_request_error", error
            assert f"context length of {context}" in error["message"], error
        prompt_field = _PROMPTS[path][0]
        over = _ask(base, user, path, "x" * 3000, max_tokens=300)  # about 750 + 300 tokens: over 1,000 a minute
        assert over.status_code == 400, over.text
        assert over.json()["error"]["param"] == prompt_field and "budget" in over.json()["error"]["message"]
        for _ in range(4):  # 400 reserved four times over is past the budget, unless each one is given back
            refused = _ask(base, user, path, max_tokens=400, temperature=-1)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature", refused.text
        assert _ask(base, user, path, max_tokens=400).status_code == 200


def test_an_image_part_is_a_400_through_the_gateway(tmp_path, replica):
    """A text-only replica answered an image-only message 200; its 400 naming the part reaches the client."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with gateway(tmp_path, [replica]) as (base, user, _, _):
        r = _chat(base, user, [{"role": "user", "content": [image]}])
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages.0.content.0" and error["type"] == "invalid_request_error", error
        assert "images are not supported" in error["message"], error


# ----------------------------------------------------------------------------- a busy fleet is a 429
def _upstream(status: int, retry_after: str | None) -> FastAPI:
    """An upstream that answers every completion with ``status``: a fault injected on purpose (our server
    answers 429 only while its queue is full, which a test cannot hold steady)."""
    app = FastAPI()

    @app.get("/health")
    @app.get("/ready")
    async def ready():
        return {"ready": True}

    @app.post("/v1/completions")
    async def completions():
        headers = {"Retry-After": retry_after} if retry_after else {}
        message = "The queue is full" if status == 429 else "the replica broke"
        return JSONResponse({"error": {"message": message, "type": "rate_limit_error", "code": status}},
                            status_code=status, headers=headers)

    return app


def test_replicas_that_all_answer_429_give_the_client_429_with_retry_after(tmp_path):
    """Every replica busy was a 503 "no replica could take the request"; it is the upstream's 429 now, with its
    Retry-After (the soonest of them), and 1 s when none sent one. A broken replica still makes it a 503."""
    with (uvicorn_thread(_upstream(429, "7")) as busy_7, uvicorn_thread(_upstream(429, "3")) as busy_3,
          uvicorn_thread(_upstream(429, None)) as busy, uvicorn_thread(_upstream(500, None)) as broken):
        with gateway(tmp_path / "a", [busy_7, busy_3]) as (base, user, admin, gw):
            since = time.time() - 1
            r = complete(base, user)
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["type"] == "rate_limit_error" and "busy" in r.json()["error"]["message"]
            assert all(rep.healthy for rep in gw.pools.all())  # busy is not broken: nobody is ejected
            stats = httpx.get(f"{base}/admin/window", params={"since": since}, headers=bearer(admin)).json()
            assert sum(v["requests"] for v in stats["variants"]) == 2  # both attempts are on record
        dead = f"http://127.0.0.1:{free_port()}"  # unreachable: it did not answer, so it does not count
        with gateway(tmp_path / "b", [busy], canary=[dead], weight=100) as (base, user, _, _):
            r = complete(base, user, user="u1")
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        with gateway(tmp_path / "c", [busy_7, broken]) as (base, user, _, _):
            r = complete(base, user)
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


# ----------------------------------------------------------------------------- a bounded access log
def test_the_access_log_rotates_and_stays_off_the_process_log(tmp_path, replica):
    """Per-request lines go to state_dir/access.log, rotated at max_bytes with `backups` old files, and not to
    the process's own output; a warning (a dead replica ejected) still goes there."""
    state, port = tmp_path / "state", free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "port": port, "model_name": MODEL, "state_dir": str(state), "health": {"interval_s": 0.2},
        "champion": {"replicas": [replica, dead], "version": "1", "served_model": "tiny-a"},
        "access_log": {"max_bytes": 2048, "backups": 2}}))
    base = f"http://127.0.0.1:{port}"
    process = gateway_process(config, tmp_path / "gateway.log")
    try:
        wait_ready(base, timeout=60)
        with httpx.Client(base_url=base, timeout=60) as client:
            for i in range(80):
                r = client.post("/v1/completions", headers={"x-request-id": f"probe-{i:03d}"},
                                json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
                assert r.status_code == 200
            deadline = time.monotonic() + 30
            while "ejected" not in (tmp_path / "gateway.log").read_text():
                assert time.monotonic() < deadline, process.tail()
                time.sleep(0.2)
    finally:
        process.stop()
    files = sorted(state.glob("access.log*"))
    assert [f.name for f in files] == ["access.log", "access.log.1", "access.log.2"]  # rotated, 2 backups kept
    assert all(f.stat().st_size <= 2048 for f in files)
    assert "probe-079" in (state / "access.log").read_text()  # the newest lines are in the live file
    process_log = (tmp_path / "gateway.log").read_text()
    assert "probe-" not in process_log and "gateway routing" in process_log


def test_access_log_settings_are_validated(tmp_path):
    from serving.gateway.config import ConfigError, load_gateway_config

    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"access_log": {"max_bytes": 10, "backups": 0}}))
    with pytest.raises(ConfigError, match="access_log"):
        load_gateway_config(path)
    path.write_text(yaml.safe_dump({"access_log": {"enabled": False}}))
    assert load_gateway_config(path).access_log.enabled is False


def test_a_disabled_access_log_writes_nothing(tmp_path):
    from serving.gateway.cli import configure_access_log
    from serving.gateway.config import AccessLogConfig, GatewayConfig

    access = logging.getLogger("serving.gateway.access")
    saved = access.handlers[:], access.propagate, access.level
    config = GatewayConfig(state_dir=str(tmp_path / "state"), access_log=AccessLogConfig(enabled=False))
    try:
        configure_access_log(config)
        access.info("one request")
        assert not Path(config.state_dir, "access.log").exists()
    finally:
        access.handlers[:], access.propagate, access.level = saved


# ----------------------------------------------------------------------------- a connection closed while idle
class _ClosesReusedConnections:
    """A minimal HTTP/1.1 upstream that answers the first request on each connection and drops the connection
    when a second one arrives on it, as a server whose keep-alive just ran out does (vLLM's is 5 s): a fault
    injected on purpose, since a real keep-alive race cannot be timed by a test."""

    BODY = b'{"id":"c","object":"text_completion","created":0,"model":"x","choices":[{"index":0,"text":"ok",' \
           b'"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,' \
           b'"total_tokens":2}}'

    def __init__(self) -> None:
        import asyncio
        import threading

        self.port = free_port()
        self.dropped = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self.thread.start()

    async def _serve(self, reader, writer) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if served:
                    self.dropped += 1
                    break  # the idle connection is gone: no answer, the socket closes
                body = b'{"ready":true}' if head.startswith(b"GET") else self.BODY
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
                served += 1
        except Exception:  # noqa: BLE001 - the client went away
            pass
        writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_pooled_connection_the_replica_closed_is_retried_not_counted_as_its_error(tmp_path):
    upstream = _ClosesReusedConnections()
    try:
        with gateway(tmp_path, [f"http://127.0.0.1:{upstream.port}"], eject_after=100) as (base, user, admin, _):
            since = time.time() - 1
            answers = [complete(base, user) for _ in range(6)]
            assert [r.status_code for r in answers] == [200] * 6, answers[-1].text
            assert upstream.dropped >= 1  # the gateway did reuse connections the upstream then dropped
            window = httpx.get(f"{base}/admin/window", params={"since": since}, headers=bearer(admin)).json()
            (row,) = window["variants"]
            assert row["requests"] == 6 and row["status_5xx"] == 0
    finally:
        upstream.close()
