"""LoRA adapters through HTTP (issue 33, item 2): `lifecycle serve BASE --lora-modules NAME=DIR` as a real
process on 127.0.0.1 (the engine in its own process, so every adapter operation crosses the core's pipe); a
request's `model` picks the adapter, /v1/models lists it with its parent, the admin key loads and unloads
adapters while a stream runs, an unknown model is 404 `model_not_found`, /metrics says which adapters run.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import httpx
import pytest

from artifacts.common.net import free_port
from tests.lora_support import make_adapter
from tests.serving.fleet_support import Process, wait_ready
from tests.serving.test_lora_engine import MAX_TOKENS, peft_greedy

ADMIN_KEY = "test-admin-key-0123456789"
PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-adapters")
    return {"support": make_adapter(tiny_model_dir, root / "support", rank=8, seed=11,
                                    targets=["q_proj", "v_proj", "o_proj", "down_proj"]),
            "sales": make_adapter(tiny_model_dir, root / "sales", rank=4, seed=12,
                                  targets=["q_proj", "k_proj", "gate_proj", "up_proj"])}


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-server")
    key_file = tmp / "admin.key"
    key_file.write_text(ADMIN_KEY)
    port = free_port()
    proc = Process([sys.executable, "-m", "serving.cli", "serve", str(tiny_model_dir), "--port", str(port),
                    "--served-model-name", "base", "--num-blocks", "256", "--block-size", "8", "--threads", "1",
                    "--lora-modules", f"support={adapters['support']}", "--max-loras", "2",
                    "--admin-key-file", str(key_file), "--log-level", "warning"], tmp / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        yield url
    except AssertionError:
        raise AssertionError(proc.tail()) from None
    finally:
        proc.stop()


def complete(url: str, model: str, prompt_ids: list[int], **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def admin(url: str, route: str, body: dict, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=60)


def prompt_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).encode(PROMPT)


def test_models_lists_the_base_and_each_adapter_with_its_parent(server, adapters):
    models = {m["id"]: m for m in httpx.get(f"{server}/v1/models").json()["data"]}
    assert models["base"]["parent"] is None
    assert models["support"]["parent"] == "base" and models["support"]["root"] == str(adapters["support"])
    assert models["support"]["lora_rank"] == 8 and models["support"]["digest"].startswith("sha256:")


def test_the_base_and_an_adapter_answer_side_by_side_as_peft_does(server, tiny_model_dir, adapters):
    ids = prompt_ids(tiny_model_dir)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # in flight together: one batch on the engine
        futures = [pool.submit(complete, server, model, ids) for model in ("base", "support") * 3]
        answers = [f.result() for f in futures]
    base, support = peft_greedy(tiny_model_dir, None, [PROMPT])[0], \
        peft_greedy(tiny_model_dir, adapters["support"], [PROMPT])[0]
    assert base != support
    for model, response in zip(("base", "support") * 3, answers, strict=True):
        assert token_ids(response) == {"base": base, "support": support}[model]
        assert response.json()["model"] == model


def test_an_unknown_model_is_404_model_not_found(server, tiny_model_dir):
    response = complete(server, "nobody", prompt_ids(tiny_model_dir))
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "nobody" in error["message"]


def test_an_adapter_loaded_while_a_stream_runs_leaves_the_stream_whole(server, tiny_model_dir, adapters):
    ids = prompt_ids(tiny_model_dir)
    body = {"model": "support", "prompt": ids, "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    streamed: list[int] = []
    loaded = None
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            streamed += chunk["choices"][0].get("token_ids") or []
            if loaded is None and len(streamed) >= 5:  # mid-stream
                loaded = admin(server, "load_lora_adapter", {"lora_name": "sales", "lora_path": str(adapters["sales"])})
    assert loaded is not None and loaded.status_code == 200, loaded.text if loaded is not None else "never loaded"
    assert len(streamed) == 150
    assert streamed[:MAX_TOKENS] == peft_greedy(tiny_model_dir, adapters["support"], [PROMPT])[0]
    assert token_ids(complete(server, "sales", ids)) == peft_greedy(tiny_model_dir, adapters["sales"], [PROMPT])[0]
    metrics = httpx.get(f"{server}/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2",model_name="base"' in metrics or \
        'vllm:lora_requests_info{model_name="base",max_lora="2"' in metrics
    # unloaded: new requests for it are refused, the others go on
    assert admin(server, "unload_lora_adapter", {"lora_name": "sales"}).status_code == 200
    assert complete(server, "sales", ids).status_code == 404
    assert complete(server, "support", ids).status_code == 200
    assert "sales" not in {m["id"] for m in httpx.get(f"{server}/v1/models").json()["data"]}


def test_adapter_routes_refuse_without_the_key_and_explain_a_bad_adapter(server, tiny_model_dir, tmp_path):
    assert admin(server, "load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}, key=None).status_code == 401
    assert admin(server, "load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"},
                 key="wrong-key-0123456789").status_code == 401
    missing = admin(server, "load_lora_adapter", {"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    gone = admin(server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")})
    assert gone.status_code == 400 and "adapter_config.json: missing" in gone.json()["error"]["message"]
    unknown = admin(server, "unload_lora_adapter", {"lora_name": "never-loaded"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    # the server still serves everyone after each refusal
    assert complete(server, "base", prompt_ids(tiny_model_dir)).status_code == 200
