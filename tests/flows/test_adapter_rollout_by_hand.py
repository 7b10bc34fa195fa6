"""The adapter form's rollout lines when the pipeline cannot rehearse the rollout itself: each case says why, and
the command it prints is one that can work (``flows/adapter_rollout.py``, `_by_hand`)."""

from __future__ import annotations

from flows.adapter_rollout import AdapterRelease, _by_hand

ADAPTER = AdapterRelease(base_model="tiny", base_version="4", base_bundle="/b", adapter_model="tiny-adapter",
                         version="2", bundle="/a", rank=48)


def test_slots_hold_the_stacked_rank_and_never_go_below_the_engine_default():
    assert ADAPTER.slots == ("--max-loras", "4", "--max-lora-rank", "48")
    small = AdapterRelease("tiny", "4", "/b", "tiny-adapter", "2", "/a", rank=12)
    assert small.slots[-1] == "16"


def test_a_base_with_no_champion_is_deployed_first_with_slots_then_the_adapter_is_rolled_out():
    first, second = _by_hand(ADAPTER, None, "/data", manual=True).lines
    assert "deploy snapshot models:/tiny/4 --max-loras 4 --max-lora-rank 48 --wait" in first
    assert second.endswith("deploy snapshot models:/tiny-adapter/2 --probes /data --wait")


def test_a_base_model_serving_another_snapshot_says_an_adapter_serves_only_on_its_base():
    first, _ = _by_hand(ADAPTER, "3", "/data", manual=False).lines
    assert "is not tiny's champion (v3)" in first and "serves only on its own base" in first


def test_a_champion_adapter_of_another_base_is_replaced_on_release_gates_not_compared_in_a_lane():
    lines = _by_hand(ADAPTER, "4", "/data", manual=False, champion=("1", "3")).lines
    assert "trained on tiny v3, this version on v4: no replica serves both" in lines[0]
    assert lines[-1].endswith("deploy snapshot models:/tiny-adapter/2 --as champion")
    assert not any("--probes" in line for line in lines)  # a lane rollout could not load the old champion
