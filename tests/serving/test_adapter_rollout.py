"""Adapter rollouts end to end (issue 33, item 5): one replica of the base serving several adapter versions, the
gateway routing each adapter's public name through its own lane (its canary and shadow are adapter versions
inside the same replica: the gateway rewrites `model`), and the rollout controller judging a lane with the same
gates, aliases on the adapter's own registered model in a real MLflow store.

The planted fault is injected on purpose and named as such: the gateway's delay drill on the lane's canary.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from serving.gateway.app import build_gateway_app
from serving.gateway.config import AdapterConfig, GatewayConfig, VariantConfig
from serving.rollout.controller import Controller
from serving.rollout.plan import CanaryStep
from serving.rollout.state import RolloutSpec
from serving.rollout.traffic import TrafficGenerator, TrafficSpec
from tests.lora_support import make_adapter
from tests.serving.fleet_support import engine_thread, free_port, make_keys, uvicorn_thread
from tests.serving.rollout_support import MODEL, fast_plan, gates_at_test_speed, model_aliases, register_versions

ADAPTER_MODEL = "support-adapter"  # the adapter's own registered model
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """PEFT adapters of the tiny model: `support` and a re-release of it (the same weights), a `support` that
    learned something else, and `sales`."""
    root = tmp_path_factory.mktemp("rollout-adapters")
    return {"support": make_adapter(tiny_model_dir, root / "support", rank=8, seed=21, targets=TARGETS),
            "support-other": make_adapter(tiny_model_dir, root / "support-other", rank=8, seed=22, targets=TARGETS),
            "sales": make_adapter(tiny_model_dir, root / "sales", rank=4, seed=23, targets=["q_proj", "up_proj"])}


@dataclass
class AdapterFleet:
    gateway_url: str
    replica_url: str
    user_key: str
    admin_key_file: str
    tracking_uri: str
    versions: dict[str, str]  # adapter label -> version of support-adapter
    gateway: object
    sales_versions: dict[str, str]  # the same for sales-adapter, when the fleet registered sales versions

    def spec(self, champion: str, candidate: str, plan, start: str = "shadow", public: str = "support"
             ) -> RolloutSpec:
        """An adapter's rollout: both versions inside the base's replica, judged in the adapter's lane."""
        versions = self.versions if public == "support" else self.sales_versions
        return RolloutSpec(model_name=f"{public}-adapter", candidate_version=versions[candidate],
                           champion_version=versions[champion], candidate_replicas=[], champion_replicas=[],
                           candidate_served_model=f"{public}@{versions[candidate]}",
                           champion_served_model=f"{public}@{versions[champion]}", lane=public,
                           gateway_url=self.gateway_url, admin_key_file=self.admin_key_file,
                           tracking_uri=self.tracking_uri, plan=plan, start=start)


@contextlib.contextmanager
def adapter_fleet(tmp: Path, tiny_model_dir: Path, adapter_dirs: dict[str, Path], labels: list[str],
                  sales_labels: tuple[str, ...] = ("sales",)):
    """The base registered as `micro` (champion), `labels` bundled against it and registered in order as versions
    of `support-adapter` (the first is champion, every one passed its offline gates), `sales_labels` likewise as
    versions of `sales-adapter`, one replica of the base bundle serving each as `support@VERSION` and
    `sales@VERSION`, and a gateway with both lanes."""
    from artifacts.adapter_bundle import write_adapter_bundle
    from artifacts.adapter_registry import register_adapter_bundle

    registry = register_versions(tmp, {"base": tiny_model_dir})
    base_bundle = registry.bundles["base"]
    versions: dict[str, dict[str, str]] = {"support": {}, "sales": {}}
    modules = {}
    cwd = os.getcwd()
    os.chdir(tmp)  # the registration runs' artifacts land in the temp dir
    try:
        for public, public_labels in (("support", labels), ("sales", sales_labels)):
            for i, label in enumerate(public_labels):
                bundle = write_adapter_bundle(adapter_dirs[label.split("#")[0]], tmp / f"{public}-{i}", base_bundle,
                                              name=public, version=str(i + 1))
                ref = register_adapter_bundle(bundle, f"{public}-adapter", base_model=MODEL,
                                              tracking_uri=registry.tracking_uri,
                                              aliases=("champion",) if i == 0 else ())
                MlflowClient(registry.tracking_uri).set_model_version_tag(f"{public}-adapter", ref.version,
                                                                          "lifecycle.gates_passed", "true")
                versions[public][label], modules[f"{public}@{ref.version}"] = ref.version, str(bundle)
    finally:
        os.chdir(cwd)
    keys_file = tmp / "keys.json"
    user, admin = make_keys(keys_file, rpm=1e6, tpm=1e9)
    admin_file = tmp / "admin.key"
    admin_file.write_text(admin)
    support, sales = versions["support"], versions["sales"]
    with engine_thread(base_bundle, "base", lora_modules=modules) as replica:
        config = GatewayConfig(port=free_port(), model_name=MODEL, state_dir=str(tmp / "gateway"),
                               keys_file=str(keys_file), champion=VariantConfig([replica], registry.versions["base"],
                                                                                "base"),
                               adapters={"support": AdapterConfig(f"support@{support[labels[0]]}",
                                                                  support[labels[0]]),
                                         "sales": AdapterConfig(f"sales@{sales[sales_labels[0]]}",
                                                                sales[sales_labels[0]])})
        config.health.interval_s = 0.2
        app = build_gateway_app(config, seed=0)
        with uvicorn_thread(app, config.port) as gateway_url:
            yield AdapterFleet(gateway_url, replica, user, str(admin_file), registry.tracking_uri, support,
                               app.state.gateway, sales)


def _ask(url: str, key: str, model: str, prompt: str = "the cat sat on") -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def _run(f: AdapterFleet, controller: Controller, seconds: float = 150):
    """The rollout under traffic to the adapter, with traffic to the base and to another adapter beside it."""
    spec = TrafficSpec(concurrency=3, max_tokens=12)
    traffic = [TrafficGenerator(f.gateway_url, f.user_key, spec, model="support").start(),
               TrafficGenerator(f.gateway_url, f.user_key, TrafficSpec(concurrency=1, max_tokens=12, seed=1),
                                model="sales").start(),
               TrafficGenerator(f.gateway_url, f.user_key, TrafficSpec(concurrency=1, max_tokens=12, seed=2),
                                model=MODEL).start()]
    try:
        state = controller.run_until_done(max_seconds=seconds, stop_when_waiting=True)
    finally:
        stats = [t.stop() for t in traffic]
    return state, stats


def test_each_adapter_answers_as_itself_through_the_gateway_in_one_batch(tmp_path, tiny_model_dir, adapter_dirs):
    with adapter_fleet(tmp_path, tiny_model_dir, adapter_dirs, ["support"]) as f:
        models = httpx.get(f"{f.gateway_url}/v1/models", headers={"authorization": f"Bearer {f.user_key}"}).json()
        assert [(m["id"], m["parent"]) for m in models["data"]] == [(MODEL, None), ("sales", MODEL),
                                                                    ("support", MODEL)]
        direct = {name: httpx.post(f"{f.replica_url}/v1/completions", timeout=60, json={
            "model": served, "prompt": "the cat sat on", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        }).json()["choices"][0]["text"] for name, served in (("support", "support@1"), ("sales", "sales@1"),
                                                             (MODEL, "base"))}
        assert len(set(direct.values())) == 3  # three different models
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # all in flight at once: one batch on the replica
            answers = list(pool.map(lambda m: (m, _ask(f.gateway_url, f.user_key, m)), [MODEL, "support", "sales"] * 2))
        for model, response in answers:
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model  # the public name, not the replica's support@1
            assert response.json()["choices"][0]["text"] == direct[model]
        unknown = _ask(f.gateway_url, f.user_key, "support@1")  # a served name is not a public one
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_an_adapter_rollout_inside_the_same_replica_is_promoted_and_touches_nothing_else(tmp_path, tiny_model_dir,
                                                                                          adapter_dirs):
    """A/A: the champion adapter registered again goes shadow, canary (against the champion adapter in the same
    batches), promoted; the base's routing and the other adapter's lane are untouched, and aliases move on the
    adapter's own registered model."""
    with adapter_fleet(tmp_path, tiny_model_dir, adapter_dirs, ["support", "support#2"]) as f:
        base_before = f.gateway.routing.state.champion
        sales_before = f.gateway.routing.state.lanes["sales"]
        controller = Controller.create(tmp_path / "rollout", f.spec("support", "support#2", fast_plan()))
        state, stats = _run(f, controller)
        assert state.phase == "promoted", (state.reason, [a["summary"] for a in state.analyses])
        assert [d["to"] for d in state.decisions if d["kind"] == "phase"][:4] == ["baseline", "shadow", "canary 50%",
                                                                                   "promoted"]
        assert sum(s.user_errors for s in stats) == 0 and stats[0].sent > 20
        routing = f.gateway.routing.state
        lane = routing.lanes["support"]
        assert lane.champion.served_model == "support@2" and not lane.active("canary") and not lane.active("shadow")
        assert routing.champion == base_before and routing.lanes["sales"] == sales_before and not routing.canary.active
        assert model_aliases(f.tracking_uri, ADAPTER_MODEL) == {"champion": f.versions["support#2"],
                                                           "previous-champion": f.versions["support"]}
        assert model_aliases(f.tracking_uri, MODEL) == {"champion": "1"}  # the base's aliases never moved
        canary_look = next(a for a in state.analyses if a["phase"] == "canary")
        traffic = {t["variant"]: t for t in canary_look["traffic"]}
        # the canary was judged against the champion adapter on the same replica, at an equal share
        assert traffic["baseline"]["version"] == f.versions["support"] and traffic["baseline"]["requests"] > 0
        assert traffic["canary"]["version"] == f.versions["support#2"] and traffic["canary"]["requests"] > 0
        # the lane's window held the adapter's requests only; the base's window none of them
        store = f.gateway.store
        base_window = store.window(state.started_at)
        assert {v["version"] for v in base_window["variants"]} == {"1"}
        assert all(v["variant"] == "champion" for v in base_window["variants"])
        assert _ask(f.gateway_url, f.user_key, "support").json()["model"] == "support"


def test_a_slow_adapter_canary_is_rolled_back_and_the_champion_adapter_keeps_its_users(tmp_path, tiny_model_dir,
                                                                                        adapter_dirs):
    """Fault injected on purpose: the gateway's delay drill on the `support` lane's canary (300 ms)."""
    plan = fast_plan(steps=[CanaryStep(30, seconds=4, min_requests=5, min_keys=5),
                            CanaryStep(60, seconds=4, min_requests=5, min_keys=5)])
    with adapter_fleet(tmp_path, tiny_model_dir, adapter_dirs, ["support", "support#2"]) as f:
        admin = {"authorization": f"Bearer {open(f.admin_key_file).read()}"}
        httpx.put(f"{f.gateway_url}/admin/lanes/support", headers=admin,
                  json={"faults": {"canary": {"delay_ms": 300}}}).raise_for_status()
        controller = Controller.create(tmp_path / "rollout", f.spec("support", "support#2", plan, start="canary"))
        state, stats = _run(f, controller)
        assert state.phase == "rolled_back", (state.reason, [a["summary"] for a in state.analyses])
        assert "ttft_ratio" in state.reason
        assert [d["to"] for d in state.decisions if d["kind"] == "phase"] == ["canary 30%", "rolled_back"]
        assert model_aliases(f.tracking_uri, ADAPTER_MODEL) == {"champion": f.versions["support"]}
        lane = f.gateway.routing.state.lanes["support"]
        assert lane.champion.served_model == "support@1" and lane.canary_weight == 0 and not lane.active("canary")
        assert sum(s.user_errors for s in stats) == 0
        tags = MlflowClient(f.tracking_uri).get_model_version(ADAPTER_MODEL, f.versions["support#2"]).tags
        assert tags["rollout.state"] == "rolled back" and tags["base_version"] == "1"


def test_an_adapter_that_learned_something_else_pauses_at_shadow_for_a_person(tmp_path, tiny_model_dir,
                                                                               adapter_dirs):
    """The shadow compares two adapter versions inside the same replica: another adapter's answers disagree far
    beyond the champion adapter's own noise floor, and the rollout pauses naming the agreement gate.

    The shadow's p95 ms/token gate is set loose (×4, as configs/smoke.yaml): the replica here is a thread beside the
    suite's other worker on two cores, and one run read ×2.68 on 118 pairs and rolled back on it (that gate is
    critical); what this test shows is the agreement gate, and the latency gates have tests of their own."""
    plan = fast_plan(gates=gates_at_test_speed(max_ms_per_token_p95_ratio=4.0))
    with adapter_fleet(tmp_path, tiny_model_dir, adapter_dirs, ["support", "support-other"]) as f:
        controller = Controller.create(tmp_path / "rollout", f.spec("support", "support-other", plan))
        state, _ = _run(f, controller, seconds=60)
        assert state.phase == "paused" and "agreement" in state.reason, state.reason
        pairs = f.gateway.store.window(state.started_at, lane="support")["pairs"]
        versions = {(p["primary_version"], p["shadow_version"]) for p in pairs}
        assert (f.versions["support"], f.versions["support-other"]) in versions
        assert f.gateway.store.window(state.started_at)["pairs"] == []  # the base's lane mirrored nothing


def test_a_lane_splits_its_own_users_sticky_and_refuses_replicas_of_its_own(tmp_path, tiny_model_dir, adapter_dirs):
    """The admin API moves one adapter's lane (what an adapter rollout's controller does): 30% of that adapter's
    conversations go to its canary, each user staying where it landed; the base and the other lane stay whole;
    `deploy status` lists the lane's variants."""
    from serving.deploy.status import adapter_rows

    with adapter_fleet(tmp_path, tiny_model_dir, adapter_dirs, ["support", "support#2"]) as f:
        admin = {"authorization": f"Bearer {open(f.admin_key_file).read()}"}
        bad = httpx.put(f"{f.gateway_url}/admin/lanes/support", headers=admin,
                        json={"canary": {"replicas": [f.replica_url], "served_model": "support@2"}})
        assert bad.status_code == 400 and "served by the champion's replicas" in bad.json()["error"]["message"]
        routed = httpx.put(f"{f.gateway_url}/admin/lanes/support", headers=admin, json={
            "canary": {"served_model": "support@2", "version": f.versions["support#2"]}, "canary_weight": 30,
            "split_salt": "test"})
        assert routed.status_code == 200, routed.text
        rows = {(r["adapter"], r["variant"]): r for r in adapter_rows(routed.json())}
        assert rows[("support", "canary")]["weight"] == 30 and rows[("support", "champion")]["weight"] == 70
        assert rows[("sales", "champion")]["weight"] == 100

        def variant_of(user: str, model: str) -> str:
            response = httpx.post(f"{f.gateway_url}/v1/completions", timeout=60, headers={
                "authorization": f"Bearer {f.user_key}"}, json={"model": model, "prompt": "hi", "max_tokens": 2,
                                                                 "user": user})
            assert response.status_code == 200, response.text
            return response.headers["x-lifecycle-variant"]

        first = {user: variant_of(user, "support") for user in (f"u{i}" for i in range(40))}
        assert 4 <= sum(v == "canary" for v in first.values()) <= 20  # ~30% of 40 users
        assert all(variant_of(user, "support") == first[user] for user in list(first)[:10])  # sticky
        assert {variant_of(user, "sales") for user in list(first)[:10]} == {"champion"}
        assert {variant_of(user, MODEL) for user in list(first)[:10]} == {"champion"}
        removed = httpx.delete(f"{f.gateway_url}/admin/lanes/sales", headers=admin)
        assert removed.status_code == 200 and "sales" not in removed.json()["lanes"]
        assert _ask(f.gateway_url, f.user_key, "sales").status_code == 404
        # a restarted gateway restores every lane as it was left (routing.json)
        from serving.gateway.routing import RoutingState, RoutingStore

        restored = RoutingStore(tmp_path / "gateway", RoutingState())
        assert restored.restored and restored.state.lanes == f.gateway.routing.state.lanes
        assert restored.state.lanes["support"].canary_weight == 30


def test_two_adapters_roll_out_at_once_each_judged_in_its_own_lane(tmp_path, tiny_model_dir, adapter_dirs):
    """Two controllers at once, one per lane: `support`'s A/A release is promoted while `sales`'s canary, under the
    gateway's delay drill on that lane alone (a fault injected on purpose), is rolled back; each alias moves on its
    own registered model, and neither rollout's evidence holds the other's requests."""
    plan = fast_plan(steps=[CanaryStep(30, seconds=4, min_requests=5, min_keys=5),
                            CanaryStep(60, seconds=4, min_requests=5, min_keys=5)])
    with adapter_fleet(tmp_path, tiny_model_dir, adapter_dirs, ["support", "support#2"],
                       sales_labels=("sales", "sales#2")) as f:
        admin = {"authorization": f"Bearer {open(f.admin_key_file).read()}"}
        httpx.put(f"{f.gateway_url}/admin/lanes/sales", headers=admin,
                  json={"faults": {"canary": {"delay_ms": 300}}}).raise_for_status()
        support = Controller.create(tmp_path / "support", f.spec("support", "support#2", plan, start="canary"))
        sales = Controller.create(tmp_path / "sales", f.spec("sales", "sales#2", plan, start="canary",
                                                             public="sales"))
        spec = TrafficSpec(concurrency=2, max_tokens=12)
        traffic = [TrafficGenerator(f.gateway_url, f.user_key, spec, model="support").start(),
                   TrafficGenerator(f.gateway_url, f.user_key, TrafficSpec(concurrency=2, max_tokens=12, seed=1),
                                    model="sales").start()]
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                done = [pool.submit(c.run_until_done, 150, stop_when_waiting=True) for c in (support, sales)]
                support_state, sales_state = (d.result() for d in done)
        finally:
            stats = [t.stop() for t in traffic]
        assert support_state.phase == "promoted", (support_state.reason,
                                                   [a["summary"] for a in support_state.analyses])
        assert sales_state.phase == "rolled_back" and "ttft_ratio" in sales_state.reason, sales_state.reason
        assert sum(s.user_errors for s in stats) == 0
        assert model_aliases(f.tracking_uri, "support-adapter") == {"champion": f.versions["support#2"],
                                                               "previous-champion": f.versions["support"]}
        assert model_aliases(f.tracking_uri, "sales-adapter") == {"champion": f.sales_versions["sales"]}
        lanes = f.gateway.routing.state.lanes
        assert lanes["support"].champion.served_model == f"support@{f.versions['support#2']}"
        assert lanes["sales"].champion.served_model == f"sales@{f.sales_versions['sales']}"
        # each rollout was judged on its own lane's requests: the drill delayed sales's canary alone (support was
        # promoted beside it), and the lanes' windows hold the two canaries apart
        since = min(support_state.started_at, sales_state.started_at)
        canary_ttft = {}
        for lane in ("support", "sales"):
            rows = [r for r in f.gateway.store.window(since, lane=lane)["variants"] if r["variant"] == "canary"]
            canary_ttft[lane] = statistics.median(x for r in rows for x in r["ttft_ms"])
        assert canary_ttft["sales"] > canary_ttft["support"] + 250, canary_ttft
