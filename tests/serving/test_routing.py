"""The sticky split with a baseline: the canary and a baseline of the champion's snapshot take equal shares,
and raising the weight moves keys only where no conversation sees its model change."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from serving.gateway.routing import RoutingState, Variant, choose_variant


def _state(weight: float, baseline: bool = True) -> RoutingState:
    return RoutingState(champion=Variant(["http://c"], "1"), canary=Variant(["http://n"], "2"),
                        baseline=Variant(["http://b"], "1") if baseline else Variant(), canary_weight=weight,
                        split_salt="rollout-1")


def _split(state: RoutingState, keys: list[str]) -> dict[str, str]:
    return {key: choose_variant(state, key) for key in keys}


def test_baseline_takes_the_canarys_share_and_keys_stay_put():
    keys = [f"user-{i}" for i in range(20_000)]
    at5, at25, at50 = (_split(_state(w), keys) for w in (5, 25, 50))
    for split, weight in ((at5, 5), (at25, 25), (at50, 50)):
        shares = {v: list(split.values()).count(v) / len(keys) for v in ("canary", "baseline", "champion")}
        assert abs(shares["canary"] - weight / 100) < 0.01 and abs(shares["baseline"] - weight / 100) < 0.01
    assert "champion" not in at50.values()  # at 50% the baseline is the whole rest
    for before, after in ((at5, at25), (at25, at50)):
        for key in keys:
            if before[key] == "canary":
                assert after[key] == "canary"  # nobody on the candidate comes back
            if after[key] != before[key]:  # keys move to the canary, or between two copies of the champion
                assert after[key] == "canary" or {before[key], after[key]} == {"champion", "baseline"}
    assert "baseline" not in _split(_state(25, baseline=False), keys).values()


def test_above_half_the_baseline_takes_what_is_left():
    state = _state(80)
    assert state.baseline_weight == 20
    split = _split(state, [f"k{i}" for i in range(10_000)])
    assert abs(list(split.values()).count("baseline") / 10_000 - 0.2) < 0.015


def test_two_gateways_agree_on_the_variant_of_every_conversation(tmp_path):
    """Two gateways in front of one fleet, each with its own random generator and state, given the same routing
    change: 1,000 conversation keys land on the same variant in both, and in a process with another hash seed."""
    from serving.gateway.app import Gateway
    from serving.gateway.config import GatewayConfig

    patch = {"champion": {"replicas": ["http://c:1"], "version": "1"}, "canary": {"replicas": ["http://n:1"],
             "version": "2"}, "baseline": {"replicas": ["http://b:1"], "version": "1"}, "canary_weight": 20,
             "split_salt": "rollout-7"}
    gateways = [Gateway(GatewayConfig(state_dir=str(tmp_path / name)), seed=seed)
                for name, seed in (("one", 1), ("two", 2))]
    try:
        for gateway in gateways:
            gateway.update_routing(dict(patch), actor="controller")
        keys = [f"conversation-{i}" for i in range(1000)]
        picks = [[choose_variant(g.routing.state, key, g.rng) for key in keys] for g in gateways]
    finally:
        for gateway in gateways:
            gateway.store.close()
    assert picks[0] == picks[1]
    assert {"canary", "baseline", "champion"} == set(picks[0])
    code = ("import json, sys; from serving.gateway.routing import RoutingState, choose_variant; "
            "state = RoutingState.from_json(json.loads(sys.argv[1])); "
            "print(json.dumps([choose_variant(state, f'conversation-{i}') for i in range(1000)]))")
    other = subprocess.run([sys.executable, "-c", code, json.dumps(gateways[0].routing.state.to_json())],
                           capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONHASHSEED": "12345"})
    assert json.loads(other.stdout) == picks[0], other.stderr[-2000:]


def test_a_named_replica_that_moved_is_routed_where_it_answers_now():
    state = RoutingState(champion=Variant(["http://a:1"], "1"), canary=Variant(["http://n:1"], "2"),
                         canary_weight=10)
    assert state.register("replica-1", "http://a:1") is None  # its first word: nothing moves
    assert state.register("replica-1", "http://a:2/") == "http://a:1"  # restarted on another port
    assert state.champion.replicas == ["http://a:2"] and state.canary.replicas == ["http://n:1"]
    # a controller that still names the address the rollout started with reaches the replica where it is
    stale = RoutingState.from_json(state.to_json() | {"champion": {"replicas": ["http://a:1"], "version": "1"}})
    assert stale.champion.replicas == ["http://a:2"]
    state.register("replica-1", "http://b:7")  # and again, on another node: every old address follows
    assert state.moved == {"http://a:1": "http://b:7", "http://a:2": "http://b:7"}
    state.register("replica-2", "http://a:1")  # an old address given to a new replica is nobody's old one
    assert "http://a:1" not in state.moved and state.champion.replicas == ["http://b:7"]
    state.forget("replica-1")
    assert state.moved == {} and "replica-1" not in state.replica_names
