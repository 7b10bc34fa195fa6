"""Rollouts end to end with real parts: engine replicas on two different tiny models, the gateway, a real
MLflow store and the controller, with replayed traffic from many users.

Faults are injected on purpose and named as such (a gateway delay drill on the canary, a replica whose
port stops answering); everything else is the real path.
"""

from __future__ import annotations

import importlib.util
import sqlite3

import pytest
from mlflow import MlflowClient

from serving.rollout.controller import Controller
from serving.rollout.plan import CanaryStep
from serving.rollout.traffic import TrafficGenerator, TrafficSpec
from tests.browser import chromium_path, headless_page, mlflow_ui_server, page_text, save_screenshot, squash_whitespace
from tests.serving.rollout_support import (
    MODEL,
    fast_plan,
    fleet,
    latency_not_the_subject,
    model_aliases,
    register_versions,
    spec_for,
)


@pytest.fixture(scope="module")
def promoted(tmp_path_factory, tiny_model_dir):
    """One good rollout (the same weights re-released as a new version), shared by the tests that read it."""
    tmp = tmp_path_factory.mktemp("promoted")
    registry = register_versions(tmp, {"a": tiny_model_dir, "a2": tiny_model_dir})
    with fleet(tmp, tiny_model_dir, tiny_model_dir) as f:
        traffic = TrafficGenerator(f["gateway_url"], f["user_key"], TrafficSpec(concurrency=3, max_tokens=12),
                                   model=MODEL).start()
        try:
            controller = Controller.create(tmp / "rollout", spec_for(f, registry, "a", "a2", fast_plan()))
            state = controller.run_until_done(max_seconds=180)
        finally:
            stats = traffic.stop()
        routing = f["gateway"].routing.state
        # which replicas answered the mirrors of the champion's own version: the noise floor's
        store = f["gateway"].store
        store.flush()
        with sqlite3.connect(store.path) as conn:
            floor_replicas = {row[0] for row in conn.execute(
                "SELECT DISTINCT replica FROM requests WHERE variant = 'shadow' AND version = ?",
                (registry.versions["a"],))}
        assert floor_replicas == {f["baseline_url"]}  # two replicas compared, as in the shadow phase
    return registry, state, stats, routing


def test_good_candidate_goes_shadow_canary_promoted(promoted):
    registry, state, stats, routing = promoted
    assert state.phase == "promoted", (state.reason, [a["summary"] for a in state.analyses])
    phases = [d["to"] for d in state.decisions if d["kind"] == "phase"]
    assert phases[:4] == ["baseline", "shadow", "canary 50%", "promoted"]
    assert model_aliases(registry.tracking_uri) == {"champion": registry.versions["a2"],
                                               "previous-champion": registry.versions["a"]}
    assert routing.champion.version == registry.versions["a2"] and not routing.canary.active
    assert stats.user_errors == 0 and stats.sent > 20
    # a phase may take more than one look on a loaded machine (an inconclusive look extends it): find each by phase
    floor = state.analyses[0]
    assert floor["phase"] == "baseline" and floor["verdicts"][0]["gate"] == "noise_floor"
    shadow_look = next(a for a in state.analyses if a["phase"] == "shadow")
    shadow = {v["gate"]: v for v in shadow_look["verdicts"]}
    assert {"error_rate", "ms_per_token_p95_ratio", "agreement", "eval_record"} <= set(shadow)
    canary_look = next(a for a in state.analyses if a["phase"] == "canary")
    canary = {v["gate"] for v in canary_look["verdicts"]}
    assert {"error_rate", "rate_limited", "ttft_ratio", "itl_ratio"} <= canary
    # the canary was judged against the baseline replica, which took the canary's share of conversations
    canary_traffic = {t["variant"]: t for t in canary_look["traffic"]}
    assert canary_traffic["baseline"]["version"] == registry.versions["a"] and canary_traffic["baseline"]["requests"]
    ttft = next(v for v in canary_look["verdicts"] if v["gate"] == "ttft_ratio")
    assert "against baseline" not in ttft["threshold"] and ttft["threshold"].endswith("× baseline")
    assert not routing.baseline.active  # retired with the rollout
    client = MlflowClient(registry.tracking_uri)
    run = client.get_run(state.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.params["steps"] == "50%/4s"
    history = client.get_metric_history(state.mlflow_run_id, "canary_weight")
    last_canary_look = [a for a in state.analyses if a["phase"] == "canary"][-1]["look"]
    assert sorted((m.step, m.value) for m in history)[-1] == (last_canary_look, 50.0)  # MLflow step = analysis
    tags = client.get_model_version(MODEL, registry.versions["a2"]).tags
    assert tags["rollout.state"] == "promoted" and tags["rollout.verdict"].startswith("pass")
    assert "agree 1.00 (floor 1.00)" in tags["rollout.vs_champion"]
    assert client.get_model_version(MODEL, registry.versions["a"]).tags["rollout.state"] == "previous champion"


@pytest.mark.skipif(chromium_path() is None or importlib.util.find_spec("playwright") is None,
                    reason="needs Debian's chromium and playwright (.ci/run installs both)")
def test_the_mlflow_ui_shows_the_aliases_and_the_rollout_run(promoted, tmp_path):
    """A person's view: the model page in a real browser shows who is champion and the rollout state, and the
    rollout run is there with its decision."""
    registry, state, _, _ = promoted
    client = MlflowClient(registry.tracking_uri)
    experiment = client.get_experiment_by_name("rollouts")
    with mlflow_ui_server(registry.tracking_uri) as ui, headless_page() as page:
        model_page = squash_whitespace(page_text(page, f"{ui}/#/models/{MODEL}", "champion"))
        assert "@ champion" in model_page and "@ previous-champion" in model_page
        assert "rollout.state : promoted" in model_page and "rollout.state : previous champion" in model_page
        save_screenshot(page, tmp_path / "model-page.png")
        run_page = squash_whitespace(page_text(
            page, f"{ui}/#/experiments/{experiment.experiment_id}/runs/{state.mlflow_run_id}", "rollout.status"))
        assert f"{MODEL} v{registry.versions['a2']} vs v{registry.versions['a']}" in run_page
        assert "promoted" in run_page
        save_screenshot(page, tmp_path / "rollout-run.png")
        print(f"screenshots: {tmp_path / 'model-page.png'} {tmp_path / 'rollout-run.png'}")


def _decisions(state, kind: str) -> list[dict]:
    return [d for d in state.decisions if d["kind"] == kind]


def _run_with_traffic(f, controller, seconds: float = 150, **traffic_kw):
    traffic = TrafficGenerator(f["gateway_url"], f["user_key"],
                               TrafficSpec(concurrency=3, max_tokens=12, **traffic_kw), model=MODEL).start()
    try:
        state = controller.run_until_done(max_seconds=seconds, stop_when_waiting=True)
    finally:
        stats = traffic.stop()
    return state, stats


def _rollout_under_drill(tmp_path, model_dir, fault: dict):
    """A canary-first rollout (30% then 60%) of the same weights re-released, with the gateway drill ``fault`` on
    the canary; returns the registry, the final state, the traffic's stats and the gateway's routing after it."""
    import httpx

    registry = register_versions(tmp_path, {"a": model_dir, "a2": model_dir})
    plan = fast_plan(steps=[CanaryStep(30, seconds=4, min_requests=5, min_keys=5),
                            CanaryStep(60, seconds=4, min_requests=5, min_keys=5)])
    with fleet(tmp_path, model_dir, model_dir) as f:
        admin = {"authorization": f"Bearer {open(f['admin_key_file']).read()}"}
        httpx.put(f"{f['gateway_url']}/admin/routing", headers=admin,
                  json={"faults": {"canary": fault}}).raise_for_status()
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2", plan, start="canary"))
        state, stats = _run_with_traffic(f, controller)
        return registry, state, stats, f["gateway"].routing.state


def test_slow_candidate_is_rolled_back_at_once_naming_the_gate(tmp_path, tiny_model_dir):
    """Fault injected on purpose: the gateway's delay drill makes the canary answer 300 ms late."""
    registry, state, stats, routing = _rollout_under_drill(tmp_path, tiny_model_dir, {"delay_ms": 300})
    assert state.phase == "rolled_back"
    assert "ttft_ratio" in state.reason
    assert [d["to"] for d in _decisions(state, "phase")] == ["canary 30%", "rolled_back"]  # 60% never ran
    assert model_aliases(registry.tracking_uri) == {"champion": registry.versions["a"]}
    assert routing.canary_weight == 0 and not routing.canary.active
    assert stats.user_errors == 0
    tags = MlflowClient(registry.tracking_uri).get_model_version(MODEL, registry.versions["a2"]).tags
    assert tags["rollout.state"] == "rolled back" and "ttft_ratio" in tags["rollout.verdict"]
    run = MlflowClient(registry.tracking_uri).get_run(state.mlflow_run_id)
    assert run.info.status == "FAILED" and run.data.tags["rollout.status"] == "rolled_back"
    artifacts = {a.path for a in MlflowClient(registry.tracking_uri).list_artifacts(state.mlflow_run_id)}
    assert {"decision_log.jsonl", "timeline.md", "comparison.md", "comparison.png"} <= artifacts


def test_a_slower_decode_with_the_same_ttft_is_rolled_back_by_inter_token_latency(tmp_path, tiny_model_dir):
    """Fault injected on purpose: the gateway's token drill holds the canary's streamed tokens at least 40 ms apart
    after the first, so only decoding is slower. itl_ratio fails; ttft_ratio, on the same requests, does not."""
    _, state, stats, _ = _rollout_under_drill(tmp_path, tiny_model_dir, {"token_gap_ms": 40})
    assert state.phase == "rolled_back", (state.phase, state.reason)
    verdicts = {v["gate"]: v for v in state.analyses[-1]["verdicts"]}
    assert verdicts["itl_ratio"]["outcome"] == "fail" and verdicts["itl_ratio"]["candidate"] > 2
    assert verdicts["ttft_ratio"]["outcome"] != "fail"
    assert [d["to"] for d in _decisions(state, "phase")] == ["canary 30%", "rolled_back"]
    assert stats.user_errors == 0


def test_a_different_model_pauses_for_a_person_who_rolls_back_by_tag(tmp_path, tiny_model_dir, tiny_model_dir_b):
    """Shadow agreement far below the noise floor is an advisory gate: the rollout pauses with the top
    disagreements logged, and a person's tag `rollout.action = rollback` ends it."""
    registry = register_versions(tmp_path, {"a": tiny_model_dir, "b": tiny_model_dir_b})
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir_b) as f:
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "b", fast_plan()))
        state, _ = _run_with_traffic(f, controller, seconds=40)
        assert state.phase == "paused" and "agreement" in state.reason, state.reason
        client = MlflowClient(registry.tracking_uri)
        artifacts = {a.path for a in client.list_artifacts(state.mlflow_run_id)}
        assert "disagreements.md" in artifacts
        assert client.get_model_version(MODEL, registry.versions["b"]).tags["rollout.state"] == "paused"
        # a person, in the MLflow UI: tag the candidate version
        client.set_model_version_tag(MODEL, registry.versions["b"], "rollout.action", "rollback")
        controller.tick()
        assert controller.state.phase == "rolled_back"
        last = _decisions(controller.state, "phase")[-1]
        assert last["actor"] == "a person (MLflow UI tag)" and "rollback" in last["cause"]
        assert "rollout.action" not in client.get_model_version(MODEL, registry.versions["b"]).tags


def test_approval_by_moving_the_champion_alias(tmp_path, tiny_model_dir):
    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir})
    plan = fast_plan(promotion_approval="required", gates=latency_not_the_subject())
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir) as f:
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2", plan, start="canary"))
        state, _ = _run_with_traffic(f, controller, seconds=40)
        assert state.phase == "awaiting_approval", (state.reason, [a["summary"] for a in state.analyses])
        # a person, in the MLflow UI: move `champion` to the candidate
        MlflowClient(registry.tracking_uri).set_registered_model_alias(MODEL, "champion", registry.versions["a2"])
        controller.tick()
        assert controller.state.phase == "promoted"
        assert model_aliases(registry.tracking_uri) == {"champion": registry.versions["a2"],
                                                   "previous-champion": registry.versions["a"]}
        champion_moves = [d for d in _decisions(controller.state, "alias") if d["detail"].startswith("champion")]
        assert len(champion_moves) == 1 and "already" in champion_moves[0]["detail"]  # the person moved it, not us
        assert champion_moves[0]["actor"] == "a person (MLflow UI)"


def test_approval_by_tag_and_resume(tmp_path, tiny_model_dir):
    from serving.rollout.plan import CanaryStep

    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir})
    plan = fast_plan(steps=[CanaryStep(20, seconds=3, min_requests=5, min_keys=5, approval="required"),
                            CanaryStep(50, seconds=3, min_requests=5, min_keys=5)], promotion_approval="required",
                     gates=latency_not_the_subject())
    client = MlflowClient(registry.tracking_uri)
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir) as f:
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2", plan, start="canary"))
        state, _ = _run_with_traffic(f, controller, seconds=30)
        assert state.phase == "awaiting_approval" and state.weight == 20
        client.set_model_version_tag(MODEL, registry.versions["a2"], "rollout.actor", "alice (deploy CLI)")
        client.set_model_version_tag(MODEL, registry.versions["a2"], "rollout.action", "resume")
        controller.tick()
        assert controller.state.phase == "canary" and controller.state.weight == 50
        state, _ = _run_with_traffic(f, controller, seconds=30)
        assert state.phase == "awaiting_approval" and state.weight == 50
        client.set_model_version_tag(MODEL, registry.versions["a2"], "rollout.action", "promote")
        controller.tick()
        assert controller.state.phase == "promoted"
        actors = [d["actor"] for d in _decisions(controller.state, "phase")]
        assert "alice (deploy CLI)" in actors and "a person (MLflow UI tag)" in actors


def test_no_traffic_is_inconclusive_and_pauses_never_passes(tmp_path, tiny_model_dir):
    from serving.rollout.plan import CanaryStep

    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir})
    plan = fast_plan(steps=[CanaryStep(50, seconds=1, min_requests=5)], max_extensions=1)
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir) as f:
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2", plan, start="canary"))
        state = controller.run_until_done(max_seconds=20, stop_when_waiting=True)  # nobody sends a request
        assert state.phase == "paused"
        assert "too few samples" in state.reason and "after 1 extension" in state.reason
        # the pause says what traffic it saw, and what would make the step conclusive
        assert "canary 0 requests from 0 keys, baseline 0 requests from 0 keys" in state.reason
        assert "no request reached the gateway" in state.reason
        assert [d["kind"] for d in state.decisions if d["kind"] == "extend"] == ["extend"]
        assert model_aliases(registry.tracking_uri)["canary"] == registry.versions["a2"]  # held, not rolled back


def test_a_step_with_too_few_users_a_side_extends_then_pauses_saying_so(tmp_path, tiny_model_dir):
    """Four users at 50%: requests aplenty, but each side's figures are at most a few users' prompts (sticky
    routing sends a user's every request to one side). The step is not judged on them: it extends, then pauses
    with the keys each side saw and that more users would settle it."""
    from serving.rollout.plan import CanaryStep

    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir})
    plan = fast_plan(steps=[CanaryStep(50, seconds=2, min_requests=5, min_keys=5)], max_extensions=1)
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir) as f:
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2", plan, start="canary"))
        traffic = TrafficGenerator(f["gateway_url"], f["user_key"], TrafficSpec(users=4, concurrency=3, max_tokens=8),
                                   model=MODEL).start()
        try:
            state = controller.run_until_done(max_seconds=40, stop_when_waiting=True)
        finally:
            traffic.stop()
    assert state.phase == "paused", state.reason
    assert [d["kind"] for d in state.decisions if d["kind"] == "extend"] == ["extend"]
    last = {v["gate"]: v for v in state.analyses[-1]["verdicts"]}
    assert last["traffic_keys"]["outcome"] == "inconclusive" and last["traffic_keys"]["samples"] <= 4
    traffic = {row["variant"]: row for row in state.analyses[-1]["traffic"]}
    judged = [traffic.get(side, {"requests": 0, "keys": 0}) for side in ("canary", "baseline")]
    assert sum(r["requests"] for r in judged) >= 10 and sum(r["keys"] for r in judged) <= 4  # not for want of requests
    assert "traffic_keys" in state.reason and "more users" in state.reason, state.reason
    assert model_aliases(registry.tracking_uri)["canary"] == registry.versions["a2"]  # held, not rolled back


def test_an_inconclusive_fact_pauses_at_once_stays_on_resume_and_a_waiver_by_tag_gets_past_it(tmp_path,
                                                                                               tiny_model_dir):
    """The candidate has no offline eval record (its gates never ran): `eval_record` is inconclusive, more traffic
    cannot change that, so the rollout pauses at the first shadow look instead of walking into canary on traffic
    gates alone. A plain resume judges the phase again and the gate is still there (never dropped); a person's
    waiver from the MLflow UI (the version tag `rollout.waive`) goes on from the paused analysis, recorded."""
    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir}, unevaluated=frozenset({"a2"}))
    client = MlflowClient(registry.tracking_uri)
    candidate = registry.versions["a2"]
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir) as f:
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2",
                                                                      fast_plan(gates=latency_not_the_subject())))
        traffic = TrafficGenerator(f["gateway_url"], f["user_key"], TrafficSpec(concurrency=3, max_tokens=12),
                                   model=MODEL).start()
        try:
            state = controller.run_until_done(max_seconds=60, stop_when_waiting=True)
            assert state.phase == "paused", state.reason
            assert "more traffic would not change it (eval_record)" in state.reason, state.reason
            assert "--waive eval_record" in state.reason
            assert not _decisions(state, "extend")
            client.set_model_version_tag(MODEL, candidate, "rollout.action", "resume")
            state = controller.run_until_done(max_seconds=60, stop_when_waiting=True)
            assert state.phase == "paused"
            assert "eval_record" in state.reason, state.reason
            shadow_looks = [a for a in state.analyses if a["phase"] == "shadow"]
            # the resumed phase is judged on a new window: its first look may also wait for traffic (an extension,
            # CI at 651525e) before it pauses again, but every look keeps the gate
            assert len(shadow_looks) >= 2, [a["summary"] for a in shadow_looks]
            for look in shadow_looks:
                (verdict,) = [v for v in look["verdicts"] if v["gate"] == "eval_record"]
                assert verdict["outcome"] == "inconclusive"
            assert "canary" not in model_aliases(registry.tracking_uri)
            client.set_model_version_tag(MODEL, candidate, "rollout.waive", "eval_record")
            state = controller.run_until_done(max_seconds=90)
        finally:
            traffic.stop()
    assert state.phase == "promoted", state.reason
    phases = [d["to"] for d in _decisions(state, "phase")]
    assert phases[-2:] == ["canary 50%", "promoted"]
    (waive,) = _decisions(state, "waive")
    assert waive["detail"] == "eval_record" and waive["actor"] == "a person (MLflow UI tag)"
    resumed = _decisions(state, "phase")[-2]
    assert "passes with eval_record waived" in resumed["cause"]  # the paused look, judged again: no re-run
    canary = [a for a in state.analyses if a["phase"] == "canary"][-1]
    assert canary["waived"] == ["eval_record"]
    tags = client.get_model_version(MODEL, candidate).tags
    assert tags["rollout.waived"].startswith("eval_record by a person (MLflow UI tag)")
    assert "rollout.waive" not in tags


def test_a_candidate_whose_offline_record_lost_its_refusals_is_rolled_back_at_shadow(tmp_path, tiny_model_dir):
    """Both versions carry the eval record the pipeline's release stage logs beside them; the candidate's says
    it answered 33 of the 43 held-out harmful prompts the champion refused. Serving the same weights, traffic
    and agreement look fine: the offline comparison alone must roll it back, before any user sees it."""
    import json

    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir})
    client = MlflowClient(registry.tracking_uri)
    for label, refused in (("a", 41), ("a2", 10)):
        results = [{"suite": "safety", "metric": "refusal_rate", "value": refused / 43, "n": 43, "slices": {}}]
        run_id = client.get_model_version(MODEL, registry.versions[label]).run_id
        client.log_text(run_id, json.dumps({"passed": True, "metrics": {}, "results": results}), "eval_record.json")
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir) as f:
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2", fast_plan()))
        state, _ = _run_with_traffic(f, controller, seconds=60)
        assert state.phase == "rolled_back", state.reason
        assert "offline_refusal" in state.reason and "harmful answered (offline) 0.767 vs 0.047" in state.reason
        assert [a["phase"] for a in state.analyses] == ["baseline", "shadow"]
        assert "canary" not in model_aliases(registry.tracking_uri)
