"""The gateway, for real: two engine servers on different tiny models, the gateway on 127.0.0.1 in front.

Covers auth, request ids, rate limits, the sticky split, shadow mirroring (and that shadow answers never
reach the user), retries before the first byte, a dead canary, streaming passthrough, the admin API and
Prometheus metrics. Gateway and engines run in threads here; the kill -9 cases run them as processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.app import build_gateway_app
from serving.gateway.config import GatewayConfig, LimitsConfig, ShadowConfig, VariantConfig
from serving.gateway.sse import with_public_model
from tests.serving.fleet_support import bearer, engine_thread, free_port, make_keys, uvicorn_thread

MODEL = "tiny"


@pytest.fixture(scope="module")
def replica_a(tiny_model_dir):
    with engine_thread(tiny_model_dir, "tiny-a") as base:
        yield base


@pytest.fixture(scope="module")
def replica_b(tiny_model_dir_b):
    with engine_thread(tiny_model_dir_b, "tiny-b") as base:
        yield base


@contextlib.contextmanager
def gateway(tmp_path: Path, champion: list[str], *, canary: list[str] = (), shadow: list[str] = (),
            weight: float = 0.0, shadow_fraction: float = 0.0, keys: bool = True, limits=None, shadow_cfg=None,
            state_dir: Path | None = None, eject_after: int = 2):
    keys_file = tmp_path / "keys.json"
    user = admin = None
    if keys:
        user, admin = make_keys(keys_file, **(limits or {"rpm": 1e6}))
    config = GatewayConfig(
        port=free_port(), model_name=MODEL, state_dir=str(state_dir or tmp_path / "gw"),
        keys_file=str(keys_file) if keys else None,
        champion=VariantConfig(list(champion), "1", "tiny-a"), canary=VariantConfig(list(canary), "2", "tiny-b"),
        shadow=VariantConfig(list(shadow), "2", "tiny-b"), canary_weight=weight,
        shadow_mirror=shadow_cfg or ShadowConfig(fraction=shadow_fraction),
        limits=LimitsConfig(), )
    config.health.interval_s = 0.2
    config.health.eject_after = eject_after
    app = build_gateway_app(config, seed=0)
    with uvicorn_thread(app, config.port) as base:
        yield base, user, admin, app.state.gateway


def complete(base: str, secret: str | None, **body) -> httpx.Response:
    headers = bearer(secret) if secret else {}
    headers.update(body.pop("headers", {}))
    return httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                      "temperature": 0, **body}, headers=headers, timeout=60)


def window(base: str, admin: str, since: float) -> dict:
    return httpx.get(f"{base}/admin/window", params={"since": since}, headers=bearer(admin), timeout=30).json()


# ----------------------------------------------------------------------------- auth, ids, limits
def test_auth_401_403_with_openai_error_bodies(tmp_path, replica_a):
    with gateway(tmp_path, [replica_a]) as (base, user, admin, _):
        missing = complete(base, None)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        wrong = complete(base, "sk-lc-not-a-key")
        assert wrong.status_code == 401 and "incorrect API key" in wrong.json()["error"]["message"]
        assert complete(base, user).status_code == 200
        forbidden = httpx.get(f"{base}/admin/routing", headers=bearer(user))
        assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
        assert httpx.get(f"{base}/admin/routing", headers=bearer(admin)).status_code == 200
        pinned = complete(base, user, headers={"x-lifecycle-variant": "canary"})
        assert pinned.status_code == 403  # only the controller may pin a variant
        # the official client works through the gateway unchanged
        client = OpenAI(base_url=f"{base}/v1", api_key=user, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.role == "assistant"


def test_request_id_is_kept_passed_upstream_and_returned(tmp_path, replica_a):
    with gateway(tmp_path, [replica_a]) as (base, user, admin, _):
        since = time.time() - 1
        r = complete(base, user, headers={"x-request-id": "trace-42"})
        assert r.headers["x-request-id"] == "trace-42"
        assert r.json()["id"] == "cmpl-trace-42"  # the replica saw the same id
        minted = complete(base, user)
        assert minted.headers["x-request-id"].startswith("gw-")
        assert minted.json()["id"] == "cmpl-" + minted.headers["x-request-id"]
        bad = complete(base, user, headers={"x-request-id": "spaces are not ok"})
        assert bad.headers["x-request-id"].startswith("gw-")
        stats = window(base, admin, since)
        assert sum(v["requests"] for v in stats["variants"]) == 3


def test_rate_limits_answer_429_with_retry_after(tmp_path, replica_a):
    with gateway(tmp_path, [replica_a], limits={"rpm": 2}) as (base, user, admin, _):
        assert complete(base, user).status_code == 200
        assert complete(base, user).status_code == 200
        limited = complete(base, user)
        assert limited.status_code == 429
        assert int(limited.headers["retry-after"]) >= 1
        assert limited.json()["error"]["type"] == "rate_limit_error"
        assert complete(base, admin).status_code == 200  # buckets are per key
    with gateway(tmp_path / "t", [replica_a], limits={"tpm": 100}) as (base, user, _, _):
        never = complete(base, user, max_tokens=500)  # more than the whole budget: no wait would admit it
        assert never.status_code == 400 and "budget" in never.json()["error"]["message"]
        assert complete(base, user, max_tokens=60, ignore_eos=True).status_code == 200
        big = complete(base, user, max_tokens=60)  # fits the budget, not what is left of it this minute
        assert big.status_code == 429 and "token rate limit" in big.json()["error"]["message"]
        assert complete(base, user, max_tokens=4).status_code == 200


# ----------------------------------------------------------------------------- sticky canary split
def test_split_is_sticky_per_session_and_weighted(tmp_path, replica_a, replica_b):
    with gateway(tmp_path, [replica_a], canary=[replica_b], weight=50) as (base, user, admin, gw):
        seen = set()
        with httpx.Client(timeout=60, headers=bearer(user)) as client:
            for _ in range(1000):
                r = client.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "1", "max_tokens": 1},
                                headers={"x-session-id": "conversation-7"})
                assert r.status_code == 200
                seen.add(r.headers["x-lifecycle-variant"])
        assert len(seen) == 1  # 1,000 requests of one conversation never flip
        # per conversation key over 2,000 keys, through the gateway's own choice function
        from serving.gateway.routing import choose_variant

        state = gw.routing.state
        share = sum(choose_variant(state, f"user-{i}") == "canary" for i in range(2000)) / 2000
        assert abs(share - 0.50) <= 0.03
        # the request's `user` field is the key when there is no session header
        users = {complete(base, user, user="alice").headers["x-lifecycle-variant"] for _ in range(20)}
        assert len(users) == 1


def test_raising_the_weight_moves_only_the_keys_that_must_move():
    from serving.gateway.routing import RoutingState, Variant, choose_variant

    keys = [f"conv-{i}" for i in range(2000)]
    state = RoutingState(champion=Variant(["http://a"]), canary=Variant(["http://b"]), canary_weight=20,
                         split_salt="rollout-1")
    before = {k: choose_variant(state, k) for k in keys}
    state.canary_weight = 40
    after = {k: choose_variant(state, k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "champion" and after[k] == "canary" for k in moved)  # nobody comes back
    assert abs(len(moved) / 2000 - 0.20) <= 0.03
    assert abs(sum(v == "canary" for v in after.values()) / 2000 - 0.40) <= 0.03
    state.split_salt = "rollout-2"  # a new rollout samples other users
    other = {k: choose_variant(state, k) for k in keys}
    assert sum(other[k] != after[k] for k in keys) > 500
    # no key at all: split per request
    state.split_salt = "rollout-1"
    import random
    rng = random.Random(0)
    draws = [choose_variant(state, None, rng) for _ in range(2000)]
    assert abs(draws.count("canary") / 2000 - 0.40) <= 0.04


# ----------------------------------------------------------------------------- shadow
def test_shadow_answers_are_compared_and_never_returned(tmp_path, replica_a, replica_b):
    prompts = [f"Question {i}: what is {i}+{i}?" for i in range(12)]
    with httpx.Client(timeout=60) as client:
        direct = [client.post(f"{replica_a}/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0}
                              ).json()["choices"][0]["text"] for p in prompts]
        other = [client.post(f"{replica_b}/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0}
                             ).json()["choices"][0]["text"] for p in prompts]
    assert direct != other  # the two models really answer differently
    with gateway(tmp_path, [replica_a], shadow=[replica_b], shadow_fraction=1.0) as (base, user, admin, gw):
        since = time.time() - 1
        got = [complete(base, user, prompt=p, max_tokens=8) for p in prompts]
        assert [r.json()["choices"][0]["text"] for r in got] == direct  # the user only ever sees the champion
        assert {r.headers["x-lifecycle-variant"] for r in got} == {"champion"}
        # streamed requests are mirrored too, and the champion's streamed text is what gets compared
        stream = httpx.post(f"{base}/v1/completions", headers=bearer(user), timeout=60,
                            json={"model": MODEL, "prompt": prompts[0], "max_tokens": 8, "temperature": 0,
                                  "stream": True})
        assert '"usage"' not in stream.text  # the gateway asked for usage; the client did not get it
        deadline = time.time() + 30
        while True:
            stats = window(base, admin, since)
            pairs = stats["pairs"]
            if pairs and pairs[0]["pairs"] >= len(prompts) + 1 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert pairs and pairs[0]["pairs"] == len(prompts) + 1
        assert pairs[0]["primary_version"] == "1" and pairs[0]["shadow_version"] == "2"
        assert pairs[0]["exact_match"] < pairs[0]["pairs"]
        # every pair, the streamed one included, has both answers' ms per output token side by side
        assert len(pairs[0]["ms_per_token"]) == len(prompts) + 1
        assert all(champion > 0 and shadow > 0 for champion, shadow in pairs[0]["ms_per_token"])
        top = stats["disagreements"][0]
        assert top["primary_text"] in direct and top["shadow_text"] in other
        assert top["first_divergence"] is not None and top["length_ratio"] > 0
        metrics = httpx.get(f"{base}/metrics").text
        assert 'lifecycle_gateway_shadow_pairs_total{outcome="disagree"}' in metrics


def test_shadow_budget_drops_mirrors_and_never_slows_users(tmp_path, replica_a, replica_b):
    shadow_cfg = ShadowConfig(fraction=1.0, max_concurrency=1)
    with gateway(tmp_path, [replica_a], shadow=[replica_b], shadow_cfg=shadow_cfg) as (base, user, admin, _):
        async def burst():
            async with httpx.AsyncClient(timeout=60, headers=bearer(user)) as client:
                return await asyncio.gather(*(client.post(f"{base}/v1/completions", json={
                    "model": MODEL, "prompt": f"p{i}", "max_tokens": 16, "ignore_eos": True}) for i in range(12)))

        responses = asyncio.run(burst())
        assert all(r.status_code == 200 for r in responses)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}
        dropped = sum(s.value for s in families["lifecycle_gateway_shadow_dropped"].samples
                      if s.name.endswith("_total"))
        assert dropped >= 1


# ----------------------------------------------------------------------------- failures users never see
def test_dead_canary_costs_users_nothing(tmp_path, replica_a):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here: a canary that died
    with gateway(tmp_path, [replica_a], canary=[dead], weight=100) as (base, user, admin, gw):
        since = time.time() - 1
        results = [complete(base, user, user=f"u{i}") for i in range(10)]
        assert all(r.status_code == 200 for r in results)
        assert {r.headers["x-lifecycle-variant"] for r in results} == {"champion"}
        stats = {v["variant"]: v for v in window(base, admin, since)["variants"]}
        assert stats["canary"]["status_5xx"] >= 1 and stats["canary"]["fallbacks"] >= 1
        routing = httpx.get(f"{base}/admin/routing", headers=bearer(admin)).json()
        canary = [r for r in routing["replicas"] if r["variant"] == "canary"][0]
        assert canary["healthy"] is False  # ejected: later requests no longer try it first


def test_retry_before_first_byte_on_another_replica_of_the_variant(tmp_path, replica_a):
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway(tmp_path, [dead, replica_a]) as (base, user, admin, _):
        results = [complete(base, user) for _ in range(6)]
        assert all(r.status_code == 200 for r in results)
    # one failure ejects: once the request has failed, the dead champion is out whether the request or the
    # health poll saw it first, so the gateway is not ready (nothing could serve)
    with gateway(tmp_path / "none", [dead], eject_after=1) as (base, user, admin, _):
        r = complete(base, user)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        ready = httpx.get(f"{base}/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "no healthy champion replica"


def test_streaming_passthrough_and_latency_records(tmp_path, replica_a):
    client_kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                 "extra_body": {"ignore_eos": True}}
    direct_body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    direct = httpx.post(f"{replica_a}/v1/completions", timeout=60, json=direct_body).json()["choices"][0]["text"]
    with gateway(tmp_path, [replica_a]) as (base, user, admin, _):
        since = time.time() - 1
        client = OpenAI(base_url=f"{base}/v1", api_key=user, max_retries=0)
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **client_kw))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == direct
        assert chunks[-1].usage.completion_tokens == 12  # asked for: passed through
        stats = {v["variant"]: v for v in window(base, admin, since)["variants"]}
        champion = stats["champion"]
        assert champion["requests"] == 1 and champion["completion_tokens"] == 12
        assert len(champion["ttft_ms"]) == 1 and len(champion["itl_ms"]) == 1


# ----------------------------------------------------------------------------- admin API and metrics
def test_admin_routing_is_validated_compare_and_set_and_persisted(tmp_path, replica_a, replica_b):
    state_dir = tmp_path / "state"
    with gateway(tmp_path, [replica_a], state_dir=state_dir) as (base, user, admin, _):
        current = httpx.get(f"{base}/admin/routing", headers=bearer(admin)).json()
        bad = httpx.put(f"{base}/admin/routing", headers=bearer(admin), json={"canary_weight": 150})
        assert bad.status_code == 400 and "canary_weight" in bad.json()["error"]["message"]
        unknown = httpx.put(f"{base}/admin/routing", headers=bearer(admin), json={"weight": 5})
        assert unknown.status_code == 400
        ok = httpx.put(f"{base}/admin/routing", headers=bearer(admin),
                       json={"canary": {"replicas": [replica_b], "version": "9", "served_model": "tiny-b"},
                             "canary_weight": 30, "expected_generation": current["generation"]})
        assert ok.status_code == 200 and ok.json()["canary_weight"] == 30
        stale = httpx.put(f"{base}/admin/routing", headers=bearer(admin),
                          json={"canary_weight": 10, "expected_generation": current["generation"]})
        assert stale.status_code == 409
    saved = json.loads((state_dir / "routing.json").read_text())
    assert saved["canary_weight"] == 30 and saved["canary"]["version"] == "9" and saved["updated_by"] == "ops"
    with gateway(tmp_path / "again", [replica_a], state_dir=state_dir) as (base, user, admin, gw):
        assert gw.routing.restored and gw.routing.state.canary_weight == 30  # the file wins over the config


def test_answers_name_the_public_model_whichever_replica_wrote_them(tmp_path, replica_a, replica_b):
    """The replicas serve as "tiny-a" and "tiny-b"; clients asked for "tiny" and must only ever see "tiny"."""
    with gateway(tmp_path, [replica_a], canary=[replica_b], weight=50) as (base, user, admin, _):
        variants, models = set(), set()
        for i in range(16):
            plain = complete(base, user, user=f"u{i}")
            variants.add(plain.headers["x-lifecycle-variant"])
            models.add(plain.json()["model"])
            chat = httpx.post(f"{base}/v1/chat/completions", headers=bearer(user), timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}, "user": f"u{i}"})
            models |= {json.loads(line[6:])["model"] for line in chat.text.splitlines()
                       if line.startswith("data: {")}
        assert variants == {"champion", "canary"} and models == {MODEL}


def test_the_model_name_is_replaced_as_a_key_never_inside_generated_text():
    event = b'{"id":"c1","model":"tiny-b","choices":[{"delta":{"content":"say \\"model\\":\\"tiny-b\\""}}]}'
    renamed = json.loads(with_public_model(event, "tiny-b", "tiny"))
    assert renamed["model"] == "tiny" and renamed["choices"][0]["delta"]["content"] == 'say "model":"tiny-b"'
    spaced = b'{"model" : "tiny-b", "choices": []}'  # another server's spacing
    assert json.loads(with_public_model(spaced, "tiny-b", "tiny"))["model"] == "tiny"
    assert with_public_model(event, "", "tiny") is event and with_public_model(event, "tiny", "tiny") is event


def test_metrics_parse_and_carry_variant_labels(tmp_path, replica_a, replica_b):
    with gateway(tmp_path, [replica_a], canary=[replica_b], weight=50) as (base, user, admin, _):
        for i in range(20):
            complete(base, user, user=f"u{i}", stream=True)
        complete(base, None)  # a 401
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}
        requests = families["lifecycle_gateway_requests"]
        variants = {s.labels["variant"] for s in requests.samples if s.name.endswith("_total")}
        assert variants == {"champion", "canary"}
        for name in ("lifecycle_gateway_time_to_first_token_seconds", "lifecycle_gateway_inter_token_latency_seconds",
                     "lifecycle_gateway_request_latency_seconds", "lifecycle_gateway_tokens",
                     "lifecycle_gateway_rejected", "lifecycle_gateway_replica_up",
                     "lifecycle_gateway_canary_weight_percent"):
            assert name in families, name
        rejected = {s.labels["reason"]: s.value for s in families["lifecycle_gateway_rejected"].samples
                    if s.name.endswith("_total")}
        assert rejected["auth"] == 1


def test_the_gateway_never_imports_torch_or_ray():
    code = ("import sys; import serving.gateway.app, serving.gateway.cli; "
            "sys.exit(1 if {'torch', 'ray'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
