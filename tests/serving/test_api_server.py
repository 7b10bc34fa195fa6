"""The OpenAI-compatible server, for real: uvicorn on 127.0.0.1, the official `openai` client, the micro model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from openai import OpenAI

from artifacts.common.net import free_port, wait_until_ready
from serving.api import build_app
from serving.api.engine_view import EngineView
from serving.api.process_engine_client import ProcessEngineClient
from serving.engine import EngineConfig, LLMEngine

MODEL = "micro"


@contextlib.contextmanager
def running_server(model_dir: Path, cfg: EngineConfig, engine_mode: str = "thread"):
    """uvicorn in a thread over the engine stepping in a thread of this process, or (``"process"``) in its
    own engine-core process, as `lifecycle serve` runs it by default."""
    if engine_mode == "process":
        core = ProcessEngineClient(model_dir, cfg)
        engine = EngineView.load(model_dir, core)
        app = build_app(engine, MODEL, client=core)
    else:
        engine = LLMEngine.from_pretrained(model_dir, cfg)
        app = build_app(engine, MODEL)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    assert wait_until_ready(f"{base}/ready", 60, interval=0.05) is None, "server never became ready"
    try:
        yield base, engine
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, micro_base_dir):
    """Every test here runs against both ways of stepping the engine: their answers must not differ."""
    with running_server(micro_base_dir, EngineConfig(num_blocks=512, block_size=8, max_num_seqs=32),
                        request.param) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def aborted(base: str) -> float:
    """Requests that ended cancelled (client gone), from the vLLM-style success counter."""
    m = re.search(r'^vllm:request_success_total\{finished_reason="abort"[^}]*\} (\S+)$',
                  httpx.get(f"{base}/metrics").text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


# ----------------------------------------------------------------------------- happy paths (openai client)
def test_health_ready_models(server, client):
    base, _ = server
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base}/ready").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_counts_usage(server, client):
    _, engine = server
    r = client.completions.create(model=MODEL, prompt="12+34=", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode("12+34="))
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_equals_non_streaming(client):
    kw = {"model": MODEL, "prompt": "Question: what is 7+5?\nAnswer:", "max_tokens": 20, "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == full and len(parts) > 1


def test_chat_completion_and_chat_stream(client):
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.usage.prompt_tokens > 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_string_is_honoured_and_not_returned(client):
    kw = {"model": MODEL, "prompt": "Question: what is 7+5?\nAnswer:", "max_tokens": 24, "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    stop = full.strip()[1:3] if len(full.strip()) >= 3 else full[:1]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert full.startswith(r.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kw)
                       if c.choices)
    assert streamed == r.choices[0].text


def test_n_choices_and_sampling_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=6, temperature=1.0, n=3, seed=1,
                                  logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=5, logprobs=True, top_logprobs=2, temperature=0.8)
    assert len(chat.choices) == 2
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 for t in content)


def test_echo_logprobs_with_max_tokens_zero_scores_the_prompt(server, client):
    """The lm-evaluation-harness local-completions loglikelihood request."""
    _, engine = server
    prompt = "What is 2+3? Answer: 5"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    ids = engine.tokenizer.encode(prompt)
    assert c.text == prompt and r.usage.completion_tokens == 0
    assert len(c.logprobs.token_logprobs) == len(ids)
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    # the same via token ids and max_tokens=1 (newer harness versions)
    r1 = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp1 = r1.choices[0].logprobs.token_logprobs
    assert len(lp1) == len(ids) + 1
    assert lp1[1:len(ids)] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)


def test_metrics_use_vllm_names(server, client):
    base, _ = server
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    text = httpx.get(f"{base}/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"]:
        assert name in text
    assert metric(base, "vllm:generation_tokens_total") >= 3


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", b"{not json", 400, "malformed JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 7}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x" * 400}, 400, "context"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [999999]}, 400, "token ids"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/nothing", {}, 404, "no route"),
    # integers that do not fit in 64 bits used to crash the engine thread for every client
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "top_k": 10 ** 20, "temperature": 1}, 400, "top_k"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "top_k": 10 ** 6, "temperature": 1}, 400,
     "vocabulary"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 64}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 63 - 1, "n": 2}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10 ** 30}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 10 ** 30}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 30]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": [[1, 10 ** 30]]}, 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    # lone surrogates and malformed content parts used to answer a plain-text 500
    ("/v1/completions", b'{"prompt": "bad \\ud800 surrogate"}', 400, "surrogate"),
    ("/v1/completions", b'{"prompt": "x", "model": "\\ud800"}', 400, "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a \\udfff"}]}', 400, "surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "text"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
])
def test_bad_requests_get_4xx_openai_error_bodies(server, path, body, status, needle):
    base, _ = server
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(base + path, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    # whatever the request did, the server goes on serving everyone else
    ok = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 1})
    assert ok.status_code == 200, ok.text
    assert httpx.get(base + "/health").status_code == 200


# ----------------------------------------------------------------------------- cancellation and load
def test_dropped_streams_free_their_kv_blocks(server):
    base, _ = server
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def drop_after_two_chunks():
        async with httpx.AsyncClient(timeout=30) as c, c.stream("POST", f"{base}/v1/completions",
                                                                 json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data:")
                if n >= 2:
                    break  # leaving the block closes the connection mid-stream

    async def main():
        await asyncio.gather(*[drop_after_two_chunks() for _ in range(12)])

    before = aborted(base)
    asyncio.run(main())
    deadline = time.monotonic() + 20
    while metric(base, "vllm:kv_cache_usage_perc") > 0 or metric(base, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "blocks of dropped streams were not freed"
        time.sleep(0.1)
    assert metric(base, "vllm:num_requests_waiting") == 0
    assert aborted(base) - before >= 1


@pytest.mark.slow
@pytest.mark.parametrize("engine_mode", ["thread", "process"])
def test_hundred_concurrent_streams_complete_or_get_429(micro_base_dir, engine_mode):
    """Admission by queue length holds in both modes (with an engine process, the API side keeps the count)."""
    cfg = EngineConfig(num_blocks=256, block_size=8, max_num_seqs=16, max_queue=24)
    with running_server(micro_base_dir, cfg, engine_mode) as (base, _):
        body = {"model": MODEL, "prompt": "Question: what is 3+4?", "max_tokens": 24, "ignore_eos": True,
                "stream": True}

        async def one(c: httpx.AsyncClient):
            async with c.stream("POST", f"{base}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, r.headers.get("retry-after"), r.json()
                lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
                return 200, lines[-1], None

        async def main():
            limits = httpx.Limits(max_connections=120)
            async with httpx.AsyncClient(timeout=90, limits=limits) as c:
                return await asyncio.wait_for(asyncio.gather(*[one(c) for _ in range(100)]), timeout=120)

        results = asyncio.run(main())
        codes = [r[0] for r in results]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(200) >= 16
        for code, extra, err in results:
            if code == 200:
                assert extra == "data: [DONE]"
            else:
                assert int(extra) >= 1 and err["error"]["type"] == "rate_limit_error"
        assert metric(base, "vllm:kv_cache_usage_perc") == 0.0


def test_non_streaming_client_disconnect_cancels(server):
    base, _ = server
    before = aborted(base)
    # 16 choices x 250 tokens: far more work than the 0.1 s the client waits
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 250, "ignore_eos": True,
                                                   "n": 16}, timeout=0.1)
    deadline = time.monotonic() + 20
    while metric(base, "vllm:num_requests_running") > 0 or metric(base, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert aborted(base) - before >= 1  # cancelled, not run to completion
    assert json.loads(httpx.get(f"{base}/health").text)["status"] == "ok"


@pytest.mark.parametrize("top", [21, 100])
def test_chat_top_logprobs_out_of_range_is_refused_naming_top_logprobs(server, top):
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "logprobs": True, "top_logprobs": top})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "top_logprobs" and err["message"].startswith("top_logprobs:"), err


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize("content,param", [
    ([IMAGE], "messages.0.content.0"),
    ([{"type": "text", "text": "what is this?"}, IMAGE], "messages.0.content.1"),
])
def test_an_image_part_is_refused_by_a_text_only_model(server, content, param):
    """An image was dropped without a word and the model answered 200 about a picture it never saw."""
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                        "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == 400, err
    assert err["message"].startswith(f"{param}: images are not supported"), err


@pytest.mark.parametrize("body,param", [
    ({"prompt": "Hello", "max_tokens": 4, "top_k": 10 ** 6}, "top_k"),  # refused by the engine as it is added
    ({"prompt": "Hello", "max_tokens": 600}, "max_tokens"),  # over the context
    ({"prompt": "Hello", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),  # by its sampling parameters
])
def test_an_engine_refusal_names_the_field(server, body, param):
    """Wherever the engine refuses a request, the error body names the field its error carries."""
    base, _ = server
    r = httpx.post(f"{base}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}:"), err


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def server_log(*names: str):
    """What the server logs under ``names`` (uvicorn's error logger does not propagate to the root)."""
    handler = _Records()
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def test_non_streaming_disconnect_is_logged_as_an_abort_not_an_error(server):
    """A client that gives up is routine: one INFO line naming the request, never an ASGI exception."""
    base, _ = server
    before = aborted(base)
    with server_log("uvicorn.error", "serving") as records:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 250, "ignore_eos": True,
                                                       "n": 4}, headers={"x-request-id": "gone-1"}, timeout=0.1)
        deadline = time.monotonic() + 20
        while aborted(base) - before < 4 or metric(base, "vllm:kv_cache_usage_perc") > 0:
            assert time.monotonic() < deadline, "the engine requests of a gone client were not aborted"
            time.sleep(0.05)
        time.sleep(0.2)
    errors = [r for r in records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]
    lines = [r.getMessage() for r in records if "gone-1" in r.getMessage()]
    assert len(lines) == 1 and "client disconnected" in lines[0] and "\n" not in lines[0], lines
    assert metric(base, "vllm:num_requests_running") == 0


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a tokenizer that prepends <s> to every encoded text, as Llama's does."""
    import shutil

    from tokenizers import Tokenizer, processors

    out = tmp_path_factory.mktemp("tiny-bos")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tok.save(str(out / "tokenizer.json"))
    return out


def test_echo_returns_the_prompt_the_client_sent(bos_model_dir):
    with running_server(bos_model_dir, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=4)) as (base, engine):
        prompt = "Hello world! Answer: 42."
        assert engine.tokenizer.encode(prompt)[0] == engine.tokenizer.bos_token_id  # the case being tested
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0,
                                                        "echo": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["text"] == prompt
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(engine.tokenizer.encode(prompt))  # the BOS is scored (and listed) too
        # every offset points at its token inside the returned text; the added <s> takes no room in it
        for tok, off in zip(lp["tokens"][1:], lp["text_offset"][1:]):
            assert c["text"][off:off + len(tok)] == tok
        assert lp["text_offset"][0] == 0
        # a list of prompts, generating: each choice starts with its own prompt
        prompts = ["Once upon", "The quick"]
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 3,
                                                        "echo": True, "temperature": 0})
        texts = [ch["text"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]
        assert [t[:len(p)] for t, p in zip(texts, prompts)] == prompts
        assert all(not t.startswith("<s>") for t in texts)
