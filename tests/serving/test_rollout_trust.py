"""Verdicts a user can trust, end to end with real parts.

- A/A through `deploy` on real `lifecycle serve` processes (the engine-core layout users run), judged with
  the plan's real tolerances: a candidate identical to the champion is never rolled back. The same story is the
  deploy command's: the first champion, a serve flag handed to the candidate's replica, the controller in the
  background as a Prefect flow that retires the old replicas when it promotes. The canary is
  judged against a baseline replica that shows as its own variant; the candidate was registered by hand
  without an eval record, so the rollout pauses on that fact until a person waives it with
  `deploy resume --waive eval_record`, which the decision log and the version's tags record.
- Probes that decide: a tiny model taught for real to answer a few sums is the champion; probes pass for
  the same model released again (above) and roll back a candidate that never learnt them (below).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from serving.rollout.controller import Controller
from serving.rollout.plan import CanaryStep, Probes
from serving.rollout.state import StateFile
from serving.rollout.traffic import TrafficGenerator, TrafficSpec
from tests.serving.rollout_support import MODEL, fast_plan, fleet, register_versions, spec_for
from tests.serving.test_fleet_faults import _fleet_record, _wait_phase, deploy

# the rollouts here are judged on latency against a baseline replica: the pair shares one core
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_prefect_server", "replicas_on_one_core")]
SUMS = [(12, 30), (45, 17), (7, 8), (23, 19), (31, 11), (9, 40), (26, 26), (14, 5)]


def _teach(model_dir: Path, out: Path, pairs: list[tuple[str, str]], steps: int = 200) -> Path:
    """Fine-tune the tiny model for real until it answers each prompt with its reply (full weights, AdamW)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = []
    for prompt, reply in pairs:
        prefix = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
        head = tok(prefix, add_special_tokens=False).input_ids
        ids = tok(prefix + reply + "<|end|>", add_special_tokens=False).input_ids
        rows.append((ids, [-100] * len(head) + ids[len(head):]))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(ids) for ids, _ in rows])[:, None]).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, f"the tiny model did not learn its sums (loss {loss.item():.3f})"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig.from_pretrained(model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def taught(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """(model dir, probe data dir): a tiny model that answers eight sums in the reply contract, and those sums
    as a data-stage output (tasks_heldout.jsonl with reference answers; no safety prompts)."""
    root = tmp_path_factory.mktemp("taught")
    pairs = [(f"What is {a} + {b}?", f"Answer: {a + b}") for a, b in SUMS]
    model = _teach(tiny_model_dir, root / "model", pairs)
    data = root / "data"
    data.mkdir()
    (data / "tasks_heldout.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n" for a, b in SUMS))
    (data / "safety_heldout.jsonl").write_text("")
    return model, data


def _probe_plan(data_dir: Path):
    return fast_plan(steps=[CanaryStep(50, seconds=10, min_requests=20)],
                     probes=Probes(data_dir=str(data_dir), tasks=len(SUMS), safety=0, max_tokens=16))


def test_a_a_through_deploy_is_never_rolled_back_and_a_waiver_gets_past_a_missing_eval_record(tmp_path, taught):
    model, data = taught
    registry = register_versions(tmp_path, {"a": model, "a2": model}, champion=False, unevaluated=frozenset({"a2"}))
    home, fleet_dir = tmp_path / "home", tmp_path / "fleet"
    common = ["--fleet", str(fleet_dir), "--tracking-uri", registry.tracking_uri]
    serve = ["--threads", "1", "--kv-memory", "16MiB"]
    try:
        first = deploy("snapshot", f"models:/{MODEL}/1", *common, *serve, home=home)
        assert first.returncode == 0, first.stderr[-3000:]
        assert "v1 is champion (first champion" in first.stdout
        status = json.loads(deploy("status", *common, "--json", home=home).stdout)
        assert status["variants"] == [{"variant": "champion", "version": "1", "replicas": 1, "healthy": 1,
                                       "weight": 100, "mirrored": None}]
        again = deploy("snapshot", f"models:/{MODEL}/1", *common, home=home)
        assert again.returncode == 0 and "version 1 is already champion" in again.stdout
        key = (fleet_dir / "traffic.key").read_text().strip()
        traffic = TrafficGenerator(_fleet_record(fleet_dir)["gateway_url"], key, TrafficSpec(
            data_dir=str(data), users=400, concurrency=3, max_tokens=12), model=MODEL).start()
        try:
            plan = tmp_path / "plan.yaml"
            plan.write_text(yaml.safe_dump(_probe_plan(data).to_json()))
            # a serve flag the fleet does not set itself goes on to the candidate's replica (one that leaves its
            # latency alone: this is an A/A); `--wait` follows the rollout here until it waits for a person
            started = deploy("snapshot", f"models:/{MODEL}/2", *common, *serve, "--max-queue", "300", "--plan",
                             str(plan), "--probes", str(data), "--wait", home=home)
            assert started.returncode == 4, started.stdout[-2000:] + started.stderr[-2000:]  # 4: paused
            assert "baseline for the canary steps: a fresh replica of v1" in started.stdout
            assert "v2's replica serves with: --max-queue 300" in started.stdout
            assert "rollout paused:" in started.stdout and "deploy promote|rollback|resume" in started.stdout
            rollout_dir = Path(_fleet_record(fleet_dir)["rollout_dir"])
            paused = _wait_phase(rollout_dir, {"paused", "rolled_back", "promoted"})
            assert paused.phase == "paused", paused.reason
            assert "eval_record" in paused.reason and "deploy resume --waive eval_record" in paused.reason
            shadow = {v["gate"]: v for v in paused.analyses[-1]["verdicts"]}
            assert shadow["eval_record"]["outcome"] == "inconclusive"
            # the probes ran for real against both models through the gateway, and decided: same answers
            assert shadow["probe_accuracy"]["outcome"] == "pass" and shadow["probe_accuracy"]["samples"] == len(SUMS)
            assert paused.probes["champion"]["correct"] == len(SUMS) == paused.probes["candidate"]["correct"]
            assert shadow["probe_sampled_accuracy"]["outcome"] == "pass"
            assert shadow["probe_sampled_accuracy"]["samples"] == len(SUMS) * Probes().samples

            resumed = deploy("resume", *common, "--waive", "eval_record", home=home)
            assert resumed.returncode == 0, resumed.stderr[-2000:]
            assert "waived eval_record" in resumed.stdout
            _wait_phase(rollout_dir, {"canary", "rolled_back", "promoted"}, timeout=120)
            status = json.loads(deploy("status", *common, "--json", home=home).stdout)
            variants = {row["variant"]: row for row in status["variants"]}
            # status reads the routing, then the state: when the state still says canary with no transition under
            # way, the routing was read in the step (on a loaded host the 10 s step can end while `deploy status`
            # starts up; the promotion moves the routing first, then the aliases, then the phase: `moving_to`)
            if status["rollout"]["phase"] == "canary" and status["rollout"]["moving_to"] is None:
                assert variants["baseline"]["version"] == "1" and variants["baseline"]["weight"] == 50
                assert variants["canary"]["version"] == "2" and variants["canary"]["weight"] == 50
            done = _wait_phase(rollout_dir, {"rolled_back", "promoted"}, timeout=300)
        finally:
            stats = traffic.stop()
        assert done.phase == "promoted", (done.reason, [a["summary"] for a in done.analyses])
        assert stats.user_errors == 0
        canary_look = next(a for a in done.analyses if a["phase"] == "canary")
        assert {t["variant"] for t in canary_look["traffic"]} >= {"canary", "baseline"}
        ttft = next(v for v in canary_look["verdicts"] if v["gate"] == "ttft_ratio")
        assert ttft["threshold"].endswith("× baseline") and ttft["outcome"] == "pass"
        waive = next(d for d in done.decisions if d["kind"] == "waive")
        assert waive["detail"] == "eval_record" and waive["actor"].endswith("(deploy CLI)")
        assert done.waivers["eval_record"]["actor"] == waive["actor"]
        client = MlflowClient(registry.tracking_uri)
        tags = client.get_model_version(MODEL, "2").tags
        assert tags["rollout.waived"].startswith("eval_record by ") and "rollout.waive" not in tags
        metrics = client.get_run(done.mlflow_run_id).data.metrics
        assert metrics["baseline.requests"] > 0 and metrics["candidate.requests"] > 0
        assert str(client.get_model_version_by_alias(MODEL, "champion").version) == "2"
        assert str(client.get_model_version_by_alias(MODEL, "previous-champion").version) == "1"
        # the background controller (a Prefect flow) retired v1's replica and the baseline when it finished
        deadline = time.monotonic() + 120
        while [r["version"] for r in _fleet_record(fleet_dir)["replicas"]] != ["2"]:
            assert time.monotonic() < deadline, _fleet_record(fleet_dir)["replicas"]
            time.sleep(0.5)
        (replica,) = _fleet_record(fleet_dir)["replicas"]
        assert replica["serve_flags"] == ["--max-queue", "300"]
        command = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().split(b"\0")
        assert command[command.index(b"--max-queue") + 1] == b"300"
        log = next((fleet_dir / "logs").glob("controller-*.log")).read_text()
        assert "rollout" in log and "promoted" in log
        shown = deploy("status", *common, home=home)
        assert shown.returncode == 0 and "promoted" in shown.stdout and "v2" in shown.stdout
    finally:
        deploy("stop", *common, home=home)


def _roll_out(tmp_path: Path, data: Path, champion: Path, candidate: Path):
    """A rollout of ``candidate`` (v2) against ``champion`` (v1) under the probe plan, with traffic; its end state."""
    registry = register_versions(tmp_path, {"a": champion, "b": candidate})
    with fleet(tmp_path, champion, candidate) as f:
        traffic = TrafficGenerator(f["gateway_url"], f["user_key"], TrafficSpec(
            data_dir=str(data), concurrency=3, max_tokens=12), model=MODEL).start()
        try:
            controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "b", _probe_plan(data)))
            return controller.run_until_done(max_seconds=180)
        finally:
            traffic.stop()


def test_probes_roll_back_a_candidate_that_lost_the_skill(tmp_path, taught, tiny_model_dir):
    model, data = taught
    state = _roll_out(tmp_path, data, model, tiny_model_dir)
    assert state.phase == "rolled_back", state.reason
    shadow = {v["gate"]: v for v in state.analyses[-1]["verdicts"]}
    assert shadow["probe_accuracy"]["outcome"] == "fail" and shadow["probe_accuracy"]["critical"]
    assert "probe_accuracy" in state.reason
    assert state.probes["champion"]["correct"] == len(SUMS) and state.probes["candidate"]["correct"] == 0
    # JSON and tool calls stay valid on both sides whatever the model knows: the grammar keeps them
    structured = 2 * min(Probes().structured, len(SUMS))
    for side in ("champion", "candidate"):
        assert state.probes[side]["structured"] == state.probes[side]["structured_valid"] == structured, side
    assert shadow["probe_structured"]["outcome"] == "pass"
    assert StateFile(tmp_path / "rollout").load().phase == "rolled_back"
    assert time.time() - state.started_at < 180


def test_probes_roll_back_a_candidate_that_lost_only_its_sampled_answers(tmp_path, taught):
    """The candidate is the champion's weights with a hotter served default (generation_config temperature 3).
    Every greedy probe is answered as before; at the server's own sampling, most answers are lost. Only the
    sampled probes can see it, and they roll it back."""
    model, data = taught
    hot = tmp_path / "hot"
    shutil.copytree(model, hot)
    config = json.loads((hot / "generation_config.json").read_text())
    (hot / "generation_config.json").write_text(json.dumps(config | {"do_sample": True, "temperature": 3.0}))
    state = _roll_out(tmp_path, data, model, hot)
    assert state.phase == "rolled_back", state.reason
    shadow = {v["gate"]: v for v in state.analyses[-1]["verdicts"]}
    assert shadow["probe_accuracy"]["outcome"] == "pass"  # the greedy answers are the champion's
    assert state.probes["candidate"]["correct"] == len(SUMS) == state.probes["champion"]["correct"]
    assert shadow["probe_sampled_accuracy"]["outcome"] == "fail" and "probe_sampled_accuracy" in state.reason
    sampled = {side: state.probes[side]["sampled_correct"] / state.probes[side]["sampled"]
               for side in ("champion", "candidate")}
    assert sampled["candidate"] <= sampled["champion"] - 0.3, sampled


def test_a_look_judges_the_sampled_draws_of_the_looks_before_it_that_did_not_settle(tmp_path, taught):
    """The behaviour gates are judged at every look until they pass. A look that did not settle them (here the
    candidate has no eval record) leaves its sampled draws to the next, which judges them with its own, prompt by
    prompt: a look adds evidence rather than a fresh chance to read within the tolerance. The greedy probes,
    which would repeat their answers, are not pooled."""
    model, data = taught
    registry = register_versions(tmp_path, {"a": model, "a2": model}, unevaluated=frozenset({"a2"}))
    plan = _probe_plan(data)
    plan.baseline_seconds = 0  # straight to shadow: the phase whose looks this judges
    with fleet(tmp_path, model, model) as f:
        controller = Controller.create(tmp_path / "rollout", spec_for(f, registry, "a", "a2", plan))
        state = controller.state
        assert state.phase == "shadow"
        looks = []
        for _ in range(2):
            analysis = controller.judge.analyse(state)
            state.analyses.append(analysis.to_json())
            looks.append({v.gate: v for v in analysis.verdicts})
    per_look = len(SUMS) * Probes().samples
    assert looks[0]["eval_record"].outcome == "inconclusive"  # nothing settled: the next look probes again
    first, second = looks[0]["probe_sampled_accuracy"], looks[1]["probe_sampled_accuracy"]
    assert first.outcome == second.outcome == "pass", (first.reason, second.reason)
    assert first.samples == per_look and "over" not in first.reason
    assert second.samples == 2 * per_look and f"of {len(SUMS)} prompts over 2 looks" in second.reason
    for side in ("champion", "candidate"):
        assert state.probes[side]["sampled_looks"] == 2 and len(state.probes[side]["sampled_draws"]) == 2 * per_look
        assert state.probes[side]["tasks"] == len(SUMS)  # greedy: the last look's answers only
    assert looks[1]["probe_accuracy"].samples == len(SUMS)


def test_probes_in_a_canary_step_load_the_baseline_as_much_as_the_candidate(tmp_path, taught):
    """Started at canary, the probes run in the first step: the baseline answers the same probes at the same
    time as the candidate, so their latencies are compared under the same extra load."""
    import sqlite3

    model, data = taught
    registry = register_versions(tmp_path, {"a": model, "a2": model})
    with fleet(tmp_path, model, model) as f:
        traffic = TrafficGenerator(f["gateway_url"], f["user_key"], TrafficSpec(
            data_dir=str(data), users=200, concurrency=3, max_tokens=12), model=MODEL).start()
        try:
            spec = spec_for(f, registry, "a", "a2", _probe_plan(data), start="canary")
            state = Controller.create(tmp_path / "rollout", spec).run_until_done(max_seconds=120)
        finally:
            traffic.stop()
        store = f["gateway"].store
        store.flush()
        with sqlite3.connect(store.path) as conn:
            probes = dict(conn.execute("SELECT variant, COUNT(*) FROM requests WHERE probe = 1 GROUP BY variant"))
    assert state.phase == "promoted", (state.reason, [a["summary"] for a in state.analyses])
    # each sum greedy, then at the served sampling; the first few as JSON and as a tool call
    sent = len(SUMS) * (1 + Probes().samples) + 2 * min(Probes().structured, len(SUMS))
    assert probes == {"champion": sent, "canary": sent, "baseline": sent}
    first = {v["gate"]: v for v in state.analyses[0]["verdicts"]}
    assert first["probe_accuracy"]["outcome"] == "pass" and first["ttft_ratio"]["threshold"].endswith("baseline")
