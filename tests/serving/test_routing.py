"""The sticky split with a baseline: the canary and a baseline of the champion's snapshot take equal shares,
and raising the weight moves keys only where no conversation sees its model change."""

from __future__ import annotations

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
