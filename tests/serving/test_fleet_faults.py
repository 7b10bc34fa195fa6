"""The fleet as users run it, with real processes: `deploy` on the command line, the controller as a Prefect
flow in the background, and kill -9 of a canary replica, of the controller and of the gateway. (The deploy
command's whole happy path, first champion to promotion, is the A/A test's in test_rollout_trust.py.)

The controller crash is injected on purpose at the worst instant (``LIFECYCLE_ROLLOUT_CRASH_AT``: right after
an alias moved, before anything recorded it); the other kills are plain SIGKILLs of real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow import MlflowClient

from serving.rollout.state import StateFile
from serving.rollout.traffic import TrafficGenerator, TrafficSpec
from tests.serving.fleet_support import (
    REPO,
    bearer,
    deploy,
    engine_thread,
    free_port,
    gateway_process,
    make_keys,
    wait_ready,
)
from tests.serving.rollout_support import MODEL, fast_plan, fleet, register_versions, spec_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_prefect_server")]


def _plan_file(tmp: Path, **overrides) -> Path:
    """The fast plan as a file for `deploy snapshot --plan`, at the gates users get."""
    plan = fast_plan(**overrides).to_json()
    path = tmp / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def _fleet_record(fleet_dir: Path) -> dict:
    return json.loads((fleet_dir / "fleet.json").read_text())


def _traffic(fleet_dir: Path) -> TrafficGenerator:
    record = _fleet_record(fleet_dir)
    key = (fleet_dir / "traffic.key").read_text().strip()
    return TrafficGenerator(record["gateway_url"], key, TrafficSpec(concurrency=3, max_tokens=12), model=MODEL)


def _wait_phase(rollout_dir: Path, phases: set[str], timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if StateFile(rollout_dir).exists():
            state = StateFile(rollout_dir).load()
            if state.phase in phases:
                return state
        time.sleep(0.3)
    raise AssertionError(f"rollout never reached {phases}")


def test_kill9_of_the_canary_replica_costs_users_nothing_and_rolls_back(tmp_path, tiny_model_dir):
    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir}, champion=False)
    home, fleet_dir = tmp_path / "home", tmp_path / "fleet"
    common = ["--fleet", str(fleet_dir), "--tracking-uri", registry.tracking_uri]
    try:
        assert deploy("snapshot", f"models:/{MODEL}/1", *common, "--kv-memory", "16MiB", home=home).returncode == 0
        # a step far longer than the test: the dead canary must fail it, not its end (on a loaded machine the
        # background controller can take over a minute to start, and would then judge a shorter step first)
        plan = _plan_file(tmp_path, steps=[fast_plan().steps[0].__class__(50, seconds=300, min_requests=5, min_keys=5)])
        traffic = _traffic(fleet_dir).start()
        try:
            started = deploy("snapshot", f"models:/{MODEL}/2", *common, "--as", "canary", "--kv-memory", "16MiB",
                             "--plan", str(plan), home=home)
            assert started.returncode == 0, started.stderr[-3000:]
            rollout_dir = Path(_fleet_record(fleet_dir)["rollout_dir"])
            _wait_phase(rollout_dir, {"canary"})
            time.sleep(2)  # the canary is taking real traffic
            candidate = next(r for r in _fleet_record(fleet_dir)["replicas"] if r["version"] == "2")
            os.killpg(candidate["pid"], signal.SIGKILL)
            state = _wait_phase(rollout_dir, {"rolled_back"}, timeout=120)
            time.sleep(2)  # traffic goes on, all on the champion
        finally:
            stats = traffic.stop()
        assert "candidate replicas unavailable" in state.reason
        assert stats.user_errors == 0 and stats.statuses[200] == stats.sent
        assert stats.variants["canary"] > 0 and stats.variants["champion"] > 0
        client = MlflowClient(registry.tracking_uri)
        assert str(client.get_model_version_by_alias(MODEL, "champion").version) == "1"
        assert client.get_model_version(MODEL, "2").tags["rollout.state"] == "rolled back"
    finally:
        deploy("stop", *common, home=home)


def test_kill9_of_the_controller_resumes_without_moving_an_alias_twice(tmp_path, tiny_model_dir):
    registry = register_versions(tmp_path, {"a": tiny_model_dir, "a2": tiny_model_dir})
    with fleet(tmp_path, tiny_model_dir, tiny_model_dir) as f:
        from serving.rollout.controller import Controller

        directory = tmp_path / "rollout"
        Controller.create(directory, spec_for(f, registry, "a", "a2", fast_plan(), start="canary")).close()
        traffic = TrafficGenerator(f["gateway_url"], f["user_key"], TrafficSpec(concurrency=3, max_tokens=12),
                                   model=MODEL).start()
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        runner = [sys.executable, "-m", "serving.rollout", "run", str(directory)]
        try:
            crashed = subprocess.run(runner, env=env | {"LIFECYCLE_ROLLOUT_CRASH_AT": "after-alias:champion"},
                                     capture_output=True, text=True, timeout=300, cwd=REPO)
            assert crashed.returncode == 137, crashed.stdout[-2000:] + crashed.stderr[-2000:]
            half = StateFile(directory).load()
            assert half.pending is not None and half.pending.to_phase == "promoted"  # died mid-transition
            client = MlflowClient(registry.tracking_uri)
            assert str(client.get_model_version_by_alias(MODEL, "champion").version) == registry.versions["a2"]
            resumed = subprocess.run(runner, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
            assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        finally:
            traffic.stop()
        state = StateFile(directory).load()
        assert state.phase == "promoted" and state.pending is None
        moves = [d["detail"] for d in state.decisions if d["kind"] == "alias"]
        assert len([m for m in moves if m.startswith("champion")]) == 1
        assert len([m for m in moves if m.startswith("previous-champion")]) == 1
        assert [d["to"] for d in state.decisions if d["kind"] == "phase"].count("promoted") == 1
        assert f["gateway"].routing.state.champion.version == registry.versions["a2"]


def test_kill9_of_the_gateway_restores_its_routing_on_restart(tmp_path, tiny_model_dir, tiny_model_dir_b):
    keys_file = tmp_path / "keys.json"
    user, admin = make_keys(keys_file, rpm=1e6, tpm=1e9)
    with engine_thread(tiny_model_dir, "a") as a_url, engine_thread(tiny_model_dir_b, "b") as b_url:
        port = free_port()
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({"port": port, "model_name": MODEL, "state_dir": str(tmp_path / "state"),
                                          "keys_file": str(keys_file),
                                          "champion": {"replicas": [a_url], "version": "1", "served_model": "a"}}))
        base = f"http://127.0.0.1:{port}"
        gateway = gateway_process(config, tmp_path / "gateway.log")
        try:
            wait_ready(base, path="/ready", timeout=60)
            routed = httpx.put(f"{base}/admin/routing", headers=bearer(admin), json={
                "canary": {"replicas": [b_url], "version": "2", "served_model": "b"}, "canary_weight": 25,
                "split_salt": "r-7"})
            assert routed.status_code == 200
            before = httpx.get(f"{base}/admin/routing", headers=bearer(admin)).json()
            gateway.kill9()
            gateway = gateway_process(config, tmp_path / "gateway.log")
            wait_ready(base, path="/ready", timeout=60)
            after = httpx.get(f"{base}/admin/routing", headers=bearer(admin)).json()
            for key in ("champion", "canary", "canary_weight", "split_salt", "generation"):
                assert after[key] == before[key], key
            seen = {httpx.post(f"{base}/v1/completions", headers=bearer(user), timeout=60,
                               json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": f"u{i}"}
                               ).headers["x-lifecycle-variant"] for i in range(40)}
            assert seen == {"champion", "canary"}
        finally:
            gateway.stop()


def test_a_stream_whose_replica_dies_mid_answer_is_finished_by_the_champion(tmp_path, tiny_model_dir):
    """kill -9 of the canary replica while it streams: the gateway asks the champion to continue from the token
    ids the canary had sent (`return_token_ids`), so the user sees one unbroken stream whose tokens are exactly
    the uninterrupted greedy answer of a healthy replica (same weights), with the whole answer's usage. The
    chat client asks for the ids and gets them; the completions client does not, and sees none.
    (Compared by token ids: this random model emits byte sequences that are not UTF-8, whose U+FFFD rendering
    depends on the detokenizer's window, so two correct streams of the same tokens can differ in text there.)"""
    from tests.serving.fleet_support import engine_process

    keys_file = tmp_path / "keys.json"
    user, admin = make_keys(keys_file, rpm=1e6, tpm=1e9)
    canary_port = free_port()
    with engine_thread(tiny_model_dir, "a") as champion_url:
        port = free_port()
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({
            "port": port, "model_name": MODEL, "state_dir": str(tmp_path / "state"), "keys_file": str(keys_file),
            "champion": {"replicas": [champion_url], "version": "1", "served_model": "a"},
            "canary": {"replicas": [f"http://127.0.0.1:{canary_port}"], "version": "2", "served_model": "b"},
            "canary_weight": 100}))
        base = f"http://127.0.0.1:{port}"
        gateway = gateway_process(config, tmp_path / "gateway.log")
        try:
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}],
                                                         "return_token_ids": True}),
                               ("/v1/completions", {"prompt": "Once upon a time"})):
                canary = engine_process(tiny_model_dir, canary_port, tmp_path / f"canary{len(path)}.log", "b")
                try:
                    wait_ready(f"http://127.0.0.1:{canary_port}", timeout=180)
                    wait_ready(base, timeout=60)
                    deadline = time.monotonic() + 30  # until the gateway's health poll takes the canary (back)
                    while not all(r["healthy"] for r in httpx.get(f"{base}/admin/routing", headers=bearer(admin)
                                                                  ).json()["replicas"]):
                        assert time.monotonic() < deadline
                        time.sleep(0.2)
                    request = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True,
                               "stream_options": {"include_usage": True}, **body}
                    events, killed = [], False
                    with httpx.stream("POST", base + path, json=request, headers=bearer(user), timeout=120) as response:
                        assert response.headers["x-lifecycle-variant"] == "canary"
                        for line in response.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            events.append(json.loads(line[6:]))
                            if len(events) == 20 and not killed:
                                canary.kill9()
                                killed = True
                    assert killed and not any("error" in e for e in events)
                    finishes = [c["finish_reason"] for e in events for c in e.get("choices", [])
                                if c.get("finish_reason")]
                    assert finishes == ["length"]
                    assert events[-1]["usage"]["completion_tokens"] == 300  # the whole answer, both replicas' part
                    # the client cannot see the seam: one answer id and the public model on every event (the
                    # replicas serve as "b" and "a"), chat chunks stay chat chunks; the fallback metric below
                    # says the champion wrote the rest
                    assert len({e["id"] for e in events}) == 1 and {e["model"] for e in events} == {MODEL}
                    assert all(e["object"] == events[0]["object"] for e in events)
                    partial = "".join(_event_text(e) for e in events[:20])  # what the canary had sent when killed
                    assert partial and len("".join(_event_text(e) for e in events)) > len(partial)
                    direct = _stream_events(champion_url + path, {**request, "model": "a", "return_token_ids": True})
                    if body.get("return_token_ids"):
                        # token for token the greedy answer a healthy replica gives to the same request, uninterrupted
                        assert _token_ids(events) == _token_ids(direct) and len(_token_ids(events)) == 300
                        assert events[0]["prompt_token_ids"] == direct[0]["prompt_token_ids"]
                    else:
                        assert not any("token_ids" in json.dumps(e) for e in events)  # not asked for: stripped
                        assert "".join(_event_text(e) for e in direct).startswith(partial)
                finally:
                    canary.stop()
            metrics = httpx.get(f"{base}/metrics").text
            assert 'lifecycle_gateway_fallbacks_total{from_variant="canary",to_variant="champion"} 2.0' in metrics
        finally:
            gateway.stop()


def _token_ids(events: list[dict]) -> list[int]:
    return [t for e in events for c in e.get("choices", []) for t in c.get("token_ids", [])]


def _stream_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _event_text(event: dict) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in event.get("choices", []))
