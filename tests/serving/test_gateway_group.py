"""Several gateways driven as one: every routing change and replica registration reaches each of them, and a
phase is judged on the union of what they saw."""

from __future__ import annotations

import contextlib

import pytest

from serving.fleet.errors import FleetError
from serving.fleet.gateway_group import GatewayGroup, merge_windows
from serving.gateway.app import build_gateway_app
from serving.gateway.config import GatewayConfig, VariantConfig
from tests.serving.fleet_support import free_port, make_keys, uvicorn_thread


def _row(variant: str, requests: int, ttft: list[float], keys: int = 1) -> dict:
    return {"variant": variant, "version": "2" if variant == "canary" else "1", "requests": requests, "keys": keys,
            "status_5xx": 1, "status_429": 0, "fallbacks": 0, "completion_tokens": 10 * requests,
            "ttft_ms": ttft, "itl_ms": [], "e2e_ms": [], "ms_per_token": []}


def _pair(pairs: int, similarity: float) -> dict:
    return {"primary_version": "1", "shadow_version": "2", "pairs": pairs, "shadow_errors": 0, "compared": pairs,
            "exact_match": pairs, "with_answer": 0, "same_answer": 0, "agree": pairs, "refusal_flips": 0,
            "similarity": similarity, "length_ratio": 1.0, "primary_ms": 10.0, "shadow_ms": 20.0}


def test_windows_from_several_gateways_add_up():
    one = {"since": 10.0, "until": 20.0, "variants": [_row("canary", 3, [1.0, 2.0, 3.0])], "pairs": [_pair(1, 0.5)],
           "disagreements": [{"refusal_primary": 0, "refusal_shadow": 0, "same_answer": 1, "similarity": 0.9}]}
    two = {"since": 10.0, "until": 21.0, "variants": [_row("canary", 2, [4.0, 5.0]), _row("champion", 5, [1.0])],
           "pairs": [_pair(3, 0.9)],
           "disagreements": [{"refusal_primary": 1, "refusal_shadow": 0, "same_answer": 1, "similarity": 0.95}]}
    merged = merge_windows([one, two], disagreements=1)
    canary = next(r for r in merged["variants"] if r["variant"] == "canary")
    assert canary["requests"] == 5 and canary["status_5xx"] == 2 and canary["keys"] == 2
    assert sorted(canary["ttft_ms"]) == [1.0, 2.0, 3.0, 4.0, 5.0]
    (pairs,) = merged["pairs"]
    assert pairs["pairs"] == 4 and pairs["similarity"] == pytest.approx((0.5 + 3 * 0.9) / 4)
    assert merged["disagreements"] == two["disagreements"]  # a refusal flip first, whichever gateway saw it
    assert (merged["since"], merged["until"]) == (10.0, 21.0)
    assert merge_windows([one]) is one


@contextlib.contextmanager
def _gateways(tmp_path, count: int):
    keys_file = tmp_path / "keys.json"
    _, admin = make_keys(keys_file)
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(count):
            config = GatewayConfig(port=free_port(), model_name="m", state_dir=str(tmp_path / f"gateway-{i}"),
                                   keys_file=str(keys_file), champion=VariantConfig(["http://127.0.0.1:9"], "1"))
            urls.append(stack.enter_context(uvicorn_thread(build_gateway_app(config), config.port)))
        yield urls, admin


def test_every_routing_change_and_registration_reaches_every_gateway(tmp_path):
    with _gateways(tmp_path, 2) as (urls, admin):
        group = GatewayGroup(urls, admin)
        try:
            group.set_routing({"canary": {"replicas": ["http://127.0.0.1:11"], "version": "2"}, "canary_weight": 5,
                               "split_salt": "r-1"}, actor="test")
            group.register_replica("replica-a", "http://127.0.0.1:11", actor="test")
            group.register_replica("replica-a", "http://127.0.0.1:12", actor="test")  # it came back elsewhere
            for member in group.members:
                routing = member.routing()
                assert routing["canary"]["replicas"] == ["http://127.0.0.1:12"] and routing["split_salt"] == "r-1"
                assert routing["replica_names"] == {"replica-a": "http://127.0.0.1:12"}
            assert group.window(0)["gateways"] == 2
            group.members[1].url = "http://127.0.0.1:9"  # a gateway that does not answer: named, after the others
            with pytest.raises(FleetError, match="127.0.0.1:9"):
                group.set_routing({"canary_weight": 10}, actor="test")
            assert group.members[0].routing()["canary_weight"] == 10
        finally:
            group.close()
