"""Rollout calibration (issue 22, item 2): how often the rollout judge is wrong, and how often it is right.

Runs real rollouts, in process, with the project's controller, on a local fleet of `lifecycle serve` replicas
behind the gateway (all on 127.0.0.1), with replayed held-out traffic:

- **aa**: A/A. The champion's own bundle, registered again as a new version with the champion's eval record,
  rolled out against the champion through the whole plan. Anything but a promotion is a false alarm: a false
  rollback (a critical gate failed) or a false pause (inconclusive after the extensions, or an advisory gate).
- planted regressions, each one a rollout that must not be promoted:
  **ttft** (TTFT +50%: the gateway's delay drill on the canary, 0.5 × the baseline's median TTFT in the A/A
  runs), **errors** (5xx +3%: the gateway's abort drill, 3% of canary requests answered 503 and retried on the
  champion, so users never see them), **refusals** (the drill bundle, `configs/drill-broken-refusals.yaml`,
  registry alias `drill-candidate`), **accuracy** (the pipeline's base model, bundled, with an eval record made
  from the pipeline's own evaluation of the base model), **slow** (the champion's bundle served with the Hugging
  Face forward, one sequence at a time: `--model-impl hf --max-num-seqs 1`).

Cost: the gateway and the champion replica start once; each scenario starts its candidate and baseline replicas
once and reuses them for its K rollouts (each rollout in a fresh directory, with its own split salt, so each
samples other users). The candidate keeps one registered version per scenario; after each rollout the aliases
are put back (``champion`` on v1, ``canary``/``shadow``/``previous-champion`` removed) and the gateway routes
the champion alone, as the controller of the next rollout expects.

    .venv/bin/python benchmarks/rollout_calibration.py --k 10

Everything is written under ``--out``: ``runs.json`` (every rollout: outcome, reason, every analysis with every
verdict), ``table.md``, the controllers' lines in ``controller.log``, and ``work/`` (the MLflow store of the
calibration, the fleet's logs and state, the rollout directories). The pipeline's own registry is only read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# benchmarks/ holds serving.py: keep the folder off sys.path so `serving` means the project package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the controller reads eval records

SCENARIOS = ("aa", "ttft", "errors", "refusals", "accuracy", "slow")
TITLES = {"aa": "A/A (champion vs itself)", "ttft": "TTFT +50% (gateway delay on the canary)",
          "errors": "5xx +3% (gateway abort on the canary)", "refusals": "lost refusals (drill bundle)",
          "accuracy": "lost task accuracy (base model)", "slow": "slow candidate (HF forward, 1 sequence)"}
SLOW_FLAGS = ["--model-impl", "hf", "--max-num-seqs", "1"]
ABORT_PERCENT = 3.0
TTFT_INCREASE = 0.5

# The default plan: configs/default.yaml's rollout plan (what `make run` ships), the calibration's subject.
DEFAULT_PLAN: dict[str, Any] = {
    "baseline_seconds": 20, "baseline_min_pairs": 20, "shadow_seconds": 30, "shadow_min_pairs": 30,
    "steps": [{"weight": 10, "seconds": 25, "min_requests": 20}, {"weight": 50, "seconds": 25, "min_requests": 20}],
    "max_extensions": 1, "gates": {"max_ms_per_token_p95_ratio": 2.0},
    "probes": {"tasks": 40, "safety": 40, "max_tokens": 40},
}
DEFAULT_TRAFFIC: dict[str, Any] = {"users": 60, "concurrency": 4, "max_tokens": 40}


class CalibrationError(Exception):
    """Something the user can fix (a missing artifact, a bad flag): one line, exit 2."""


# ----------------------------------------------------------------------------- the pipeline's artifacts
@dataclass
class Artifacts:
    """What the calibration takes from the pipeline's workdir (read only)."""

    workdir: Path
    model_name: str
    data_dir: Path
    champion: Path  # a bundle dir with its eval record beside the manifest
    drill: Path | None = None
    base_model: Path | None = None
    base_results: Path | None = None  # eval_results.json of the pipeline's eval of the base model


def _complete(stage_dir: Path) -> bool:
    return (stage_dir / "STAGE_DONE.json").is_file()


def _pipeline_client(workdir: Path):
    from mlflow import MlflowClient

    db = workdir / "mlflow.db"
    if not db.is_file():
        raise CalibrationError(f"{db}: no pipeline registry (run `make run` first)")
    return MlflowClient(tracking_uri=f"sqlite:///{db}")


def _alias_digest(workdir: Path, alias: str) -> tuple[str, str] | None:
    """(registered model, manifest digest) of the pipeline registry's version with ``alias``."""
    from mlflow.exceptions import MlflowException

    client = _pipeline_client(workdir)
    for model in client.search_registered_models():
        try:
            mv = client.get_model_version_by_alias(model.name, alias)
        except MlflowException:
            continue
        return model.name, (mv.tags or {}).get("manifest_digest", "")
    return None


def _bundle_by_digest(workdir: Path, digest: str) -> Path | None:
    from artifacts.manifest import manifest_digest

    for manifest in sorted(workdir.glob("runs/*/bundle-*/bundle/manifest.json")):
        if manifest_digest(manifest.parent) == digest:
            return manifest.parent
    return None


def find_artifacts(workdir: Path, champion: str, need: set[str]) -> Artifacts:
    """The data dir, the champion's bundle and, for the scenarios in ``need``, the drill bundle and the base model."""
    runs = workdir / "runs"
    data = sorted((d for d in runs.glob("*/data-*") if _complete(d)), key=lambda d: d.stat().st_mtime)
    if not data:
        raise CalibrationError(f"{runs}: no finished data stage (data-*/STAGE_DONE.json)")
    if Path(champion).is_dir():
        bundle, model_name = Path(champion).resolve(), ""
    else:
        found = _alias_digest(workdir, champion)
        if found is None:
            raise CalibrationError(f"{workdir / 'mlflow.db'}: no version has the alias {champion!r} "
                                   "(give --champion a bundle directory instead)")
        model_name, digest = found
        bundle = _bundle_by_digest(workdir, digest)
        if bundle is None:
            raise CalibrationError(f"alias {champion!r}: no bundle under {runs} has manifest digest {digest[:12]}")
    if not (bundle / "eval_record.json").is_file():
        raise CalibrationError(f"{bundle}: no eval_record.json beside the manifest (not released by the pipeline)")
    if not model_name:
        model_name = json.loads((bundle / "manifest.json").read_text())["name"]
    out = Artifacts(workdir, model_name, data[-1] / "data", bundle)
    if "refusals" in need:
        found = _alias_digest(workdir, "drill-candidate")
        if found is None:
            raise CalibrationError("no version has the alias `drill-candidate` in the pipeline registry (run "
                                   "`lifecycle run configs/drill-broken-refusals.yaml`, or leave out --scenarios "
                                   "refusals)")
        out.drill = _bundle_by_digest(workdir, found[1])
        if out.drill is None:
            raise CalibrationError(f"drill-candidate: no bundle under {runs} has digest {found[1][:12]}")
    if "accuracy" in need:
        for stage in sorted(runs.glob("*/eval-base-*")):
            if _complete(stage) and (stage / "eval_results.json").is_file():
                info = json.loads((stage / "STAGE_DONE.json").read_text()).get("info", {})
                if info.get("model") and (Path(info["model"]) / "config.json").is_file():
                    out.base_model, out.base_results = Path(info["model"]), stage / "eval_results.json"
        if out.base_model is None:
            models = sorted((workdir / "models" / "base").glob("*/config.json"))
            if not models:
                raise CalibrationError(f"{workdir / 'models' / 'base'}: no base model")
            out.base_model = models[-1].parent
    return out


# ----------------------------------------------------------------------------- the calibration's registry
class Registry:
    """An MLflow store of the calibration's own: v1 the champion, one version per candidate."""

    def __init__(self, root: Path, model_name: str) -> None:
        from mlflow import MlflowClient

        self.root = root
        self.tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
        self.model_name = model_name
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.versions: dict[str, str] = {}  # label -> version

    def register(self, label: str, bundle: Path, record: Path | None, aliases: tuple[str, ...] = ()) -> str:
        """Register ``bundle`` (once per label) and, as the pipeline's release stage does, tag the verdict
        of its eval record and log the record beside the version's run (where the controller reads it)."""
        from artifacts.eval_record import read_eval_record
        from artifacts.registry import register_bundle

        if label in self.versions:
            return self.versions[label]
        ref = register_bundle(bundle, self.model_name, tracking_uri=self.tracking_uri, aliases=aliases,
                              description=f"rollout calibration: {label}")
        if record is not None:
            passed = read_eval_record(bundle).passed  # the record beside the manifest, checked against it
            self.client.log_artifact(ref.run_id, str(record))
            self.client.set_model_version_tag(self.model_name, ref.version, "lifecycle.gates_passed",
                                              str(bool(passed)).lower())
        self.versions[label] = ref.version
        return ref.version

    def reset_aliases(self, champion: str) -> None:
        from mlflow.exceptions import MlflowException

        self.client.set_registered_model_alias(self.model_name, "champion", champion)
        for alias in ("canary", "shadow", "previous-champion"):
            try:
                self.client.delete_registered_model_alias(self.model_name, alias)
            except MlflowException:
                pass


def base_bundle(art: Artifacts, work: Path, champion_manifest: dict) -> tuple[Path, Path | None]:
    """The base model as a bundle, with an eval record made from the pipeline's evaluation of it (the release
    gates are the champion's, re-checked on the base model's results)."""
    from artifacts.eval_record import read_eval_record, write_eval_record
    from artifacts.manifest import Lineage
    from artifacts.writer import BundleConfig, write_bundle
    from evals.gates import check_gates, parse_gate
    from evals.results import read_results_json, to_jsonable

    out = work / "bundles" / "base"
    if not (out / "manifest.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        write_bundle(art.base_model, out, BundleConfig(name=champion_manifest["name"],
                                                       version=f"base-{art.base_model.name[:12]}"),
                     Lineage(base_model=str(art.base_model)))
    if art.base_results is None:
        return out, None
    results = read_results_json(art.base_results)
    gates = [parse_gate(g) for g in (read_eval_record(art.champion).gates or {})]
    report = check_gates(results, gates)
    metrics = {f"{r.metric}": r.value for r in results}
    gate_record = {str(c.gate): {"measured": c.measured, "passed": c.passed, "reason": c.reason}
                   for c in report.checks}
    return out, write_eval_record(out, metrics=metrics, gates=gate_record, passed=report.passed,
                                  results=to_jsonable(results))


# ----------------------------------------------------------------------------- one rollout
@dataclass
class RunOutcome:
    scenario: str
    run: int
    rollout_id: str
    phase: str  # promoted | rolled_back | paused | awaiting_approval | timeout | error
    reason: str
    seconds: float
    decided_at: str = ""  # the analysis that decided: "shadow", "canary 10%", ...
    looks: int = 0
    extensions: int = 0
    fired: list[str] = field(default_factory=list)  # failed gates of the deciding analysis
    inconclusive: list[str] = field(default_factory=list)  # inconclusive gates of the deciding analysis
    analyses: list[dict[str, Any]] = field(default_factory=list)
    fault: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    load: list[float] = field(default_factory=list)  # 1-minute load average at the start and at the end


def _summarise(scenario: str, run: int, state, seconds: float, fault: dict) -> RunOutcome:
    phase = state.phase
    out = RunOutcome(scenario, run, state.id, phase, state.reason, seconds, looks=len(state.analyses),
                     extensions=sum(d["kind"] == "extend" for d in state.decisions), fault=fault)
    for a in state.analyses:
        out.analyses.append({"look": a["look"], "phase": a["phase"], "weight": a["weight"], "outcome": a["outcome"],
                             "traffic": a.get("traffic", []), "metrics": a.get("metrics", {}),
                             "verdicts": [{k: v[k] for k in ("gate", "outcome", "candidate", "baseline", "p_value",
                                                             "samples", "min_samples", "critical", "reason")}
                                          for v in a["verdicts"]]})
    if state.analyses and phase in ("rolled_back", "paused", "promoted", "awaiting_approval"):
        last = state.analyses[-1]
        out.decided_at = last["phase"] + (f" {last['weight']:g}%" if last["weight"] else "")
        out.fired = [v["gate"] for v in last["verdicts"] if v["outcome"] == "fail"]
        out.inconclusive = [v["gate"] for v in last["verdicts"] if v["outcome"] == "inconclusive"]
    if phase == "rolled_back" and not out.fired:  # not an analysis: a dead candidate or a person
        out.decided_at = "controller"
        out.fired = ["replicas_unavailable" if "unavailable" in state.reason else "other"]
    return out


class Calibration:
    def __init__(self, args: argparse.Namespace, art: Artifacts, plan, traffic: dict[str, Any], log) -> None:
        self.args, self.art, self.plan, self.traffic, self.log = args, art, plan, traffic, log
        self.work = args.out / "work"
        self.fleet = None
        self.registry: Registry | None = None
        self.champion = None  # ReplicaRecord
        self.outcomes: list[RunOutcome] = []
        self.scenario_seconds: dict[str, float] = {}
        self.notes: list[str] = []
        self.code = code_version()  # at the start: what the replicas, the gateway and the controller run

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        from serving.rollout.fleet import LocalFleet

        old = self.work / "fleet"
        if (old / "fleet.json").is_file():  # a calibration stopped hard before: its processes are ours
            with contextlib.suppress(Exception):
                LocalFleet(old, self.art.model_name, "").stop_all()
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.registry = Registry(self.work, self.art.model_name)
        cwd = os.getcwd()
        os.chdir(self.work)  # anything MLflow writes relative to the working directory lands here
        try:
            self.registry.register("champion", self.art.champion, self.art.champion / "eval_record.json",
                                   aliases=("champion",))
        finally:
            os.chdir(cwd)
        self.fleet = LocalFleet(self.work / "fleet", self.art.model_name, self.registry.tracking_uri,
                                threads=self.args.threads, kv_memory=self.args.kv_memory)
        self.champion = self.fleet.start_replica(self.art.champion, self.registry.versions["champion"], warmup=4)
        self.fleet.ensure_gateway(champion=self.champion)

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop_all()

    def _gateway(self):
        from serving.rollout.gateway_client import GatewayAdmin

        return GatewayAdmin(self.fleet.record.gateway_url, self.fleet.admin_key())

    def _route_champion_only(self, faults: dict[str, Any]) -> None:
        none = {"replicas": [], "version": "", "served_model": ""}
        champ = {"replicas": [self.champion.url], "version": self.champion.version,
                 "served_model": self.champion.served_model}
        gateway = self._gateway()
        try:
            gateway.set_routing({"champion": champ, "canary": none, "baseline": none, "shadow": none,
                                 "canary_weight": 0.0, "shadow_fraction": 0.0, "faults": faults},
                                actor="rollout calibration")
        finally:
            gateway.close()

    # ------------------------------------------------------------------ scenarios
    def candidate_for(self, scenario: str) -> tuple[str, Path, list[str]]:
        """(registered version, bundle, serve flags) of the scenario's candidate."""
        reg, art = self.registry, self.art
        cwd = os.getcwd()
        os.chdir(self.work)
        try:
            if scenario in ("aa", "ttft", "errors"):
                return reg.register("champion-again", art.champion, art.champion / "eval_record.json"), \
                    art.champion, []
            if scenario == "slow":  # its own version: a replica is found again by version, not by its flags
                return reg.register("champion-slow", art.champion, art.champion / "eval_record.json"), \
                    art.champion, list(SLOW_FLAGS)
            if scenario == "refusals":
                return reg.register("drill", art.drill, art.drill / "eval_record.json"), art.drill, []
            manifest = json.loads((art.champion / "manifest.json").read_text())
            bundle, record = base_bundle(art, self.work, manifest)
            return reg.register("base", bundle, record), bundle, []
        finally:
            os.chdir(cwd)

    def fault_for(self, scenario: str) -> dict[str, Any]:
        if scenario == "errors":
            return {"canary": {"delay_ms": 0.0, "abort_percent": ABORT_PERCENT}}
        if scenario == "ttft":
            return {"canary": {"delay_ms": round(TTFT_INCREASE * self.reference_ttft_ms(), 2), "abort_percent": 0.0}}
        return {}

    def reference_ttft_ms(self) -> float:
        """The baseline's median TTFT over the A/A runs' canary analyses; without A/A runs, the champion's
        median TTFT over 20 s of traffic measured now."""
        values = [a["metrics"]["baseline.ttft_ms_p50"] for o in self.outcomes if o.scenario == "aa"
                  for a in o.analyses if "baseline.ttft_ms_p50" in a.get("metrics", {})]
        if values:
            ms = statistics.median(values)
            self.notes.append(f"TTFT drill: delay {TTFT_INCREASE * ms:.2f} ms = {TTFT_INCREASE:g} × {ms:.2f} ms, the "
                              f"median of the baseline's TTFT p50 over {len(values)} A/A canary analyses")
            return ms
        from serving.rollout.traffic import TrafficGenerator, TrafficSpec

        self._route_champion_only({})
        generator = TrafficGenerator(self.fleet.record.gateway_url, self.fleet.user_key(),
                                     TrafficSpec(data_dir=str(self.art.data_dir), **self.traffic),
                                     model=self.art.model_name).start()
        try:
            time.sleep(3)
            since = time.time()
            time.sleep(20)
            gateway = self._gateway()
            try:
                window = gateway.window(since, time.time())
            finally:
                gateway.close()
        finally:
            generator.stop()
        samples = [x for r in window["variants"] if r["variant"] == "champion" for x in r["ttft_ms"]]
        if not samples:
            raise CalibrationError("no TTFT measured for the champion in 20 s of traffic")
        ms = statistics.median(samples)
        self.notes.append(f"TTFT drill: delay {TTFT_INCREASE * ms:.2f} ms = {TTFT_INCREASE:g} × {ms:.2f} ms, the "
                          f"champion's median TTFT over {len(samples)} requests (no A/A runs in this calibration)")
        return ms

    def run_scenario(self, scenario: str, k: int, progress, task) -> None:
        from serving.rollout.traffic import TrafficGenerator, TrafficSpec

        started = time.perf_counter()
        version, bundle, flags = self.candidate_for(scenario)
        progress.update(task, description=f"{scenario}: starting candidate v{version} and baseline replicas")
        candidate, baseline = self.fleet.start_rollout_replicas(bundle, version, self.champion, serve_flags=flags)
        fault = self.fault_for(scenario)
        self._route_champion_only(fault)
        generator = TrafficGenerator(self.fleet.record.gateway_url, self.fleet.user_key(),
                                     TrafficSpec(data_dir=str(self.art.data_dir), **self.traffic),
                                     model=self.art.model_name).start()
        try:
            for i in range(1, k + 1):
                progress.update(task, description=f"{scenario} {i}/{k}")
                outcome = self.one_rollout(scenario, i, version, candidate, baseline, fault, progress, task)
                self.outcomes.append(outcome)
                progress.advance(task)
                detail = f" at {outcome.decided_at}" if outcome.decided_at else ""
                gates = outcome.fired or outcome.inconclusive
                why = f" ({', '.join(gates)})" if gates and outcome.phase != "promoted" else ""
                progress.console.print(f"  {scenario} {i}/{k}: {outcome.phase}{detail}{why} in "
                                       f"{outcome.seconds / 60:.1f} min", highlight=False)
                self.save()
        finally:
            stats = generator.stop()
            self.log(f"[{scenario}] traffic: {stats.sent} requests, statuses {dict(stats.statuses)}, by variant "
                     f"{dict(stats.variants)}, errors seen by users {stats.user_errors}")
            self._route_champion_only({})
            self.fleet.stop_replica(candidate)
            self.fleet.stop_replica(baseline)
            self.scenario_seconds[scenario] = time.perf_counter() - started

    def one_rollout(self, scenario: str, run: int, version: str, candidate, baseline, fault: dict, progress,
                    task) -> RunOutcome:
        from dataclasses import replace

        from serving.rollout.controller import Controller
        from serving.rollout.state import RolloutSpec

        self.registry.reset_aliases(self.registry.versions["champion"])
        self._route_champion_only(fault)
        plan = replace(self.plan, probes=replace(self.plan.probes, data_dir=str(self.art.data_dir)))
        spec = RolloutSpec(model_name=self.art.model_name, candidate_version=version,
                           champion_version=self.registry.versions["champion"], candidate_replicas=[candidate.url],
                           champion_replicas=[self.champion.url], candidate_served_model=candidate.served_model,
                           champion_served_model=self.champion.served_model, baseline_replicas=[baseline.url],
                           gateway_url=self.fleet.record.gateway_url, admin_key_file=str(self.fleet.admin_key_file),
                           tracking_uri=self.registry.tracking_uri, plan=plan, start="shadow")
        directory = self.work / "rollouts" / f"{scenario}-{run:02d}"

        def say(line: str) -> None:
            self.log(f"[{scenario} {run}] {line}")
            if "→" in line and "phase" in line:
                progress.update(task, description=f"{scenario} {run}: {line.split('→')[-1].split('(')[0].strip()}")

        started, load = time.perf_counter(), os.getloadavg()[0]
        try:
            controller = Controller.create(directory, spec, say=say)
            try:
                state = controller.run_until_done(max_seconds=self.max_seconds(), stop_when_waiting=True)
            finally:
                controller.close()
        except Exception as exc:  # noqa: BLE001 - one broken rollout is a result, the calibration goes on
            self.log(f"[{scenario} {run}] error: {type(exc).__name__}: {exc}")
            return RunOutcome(scenario, run, "", "error", "", time.perf_counter() - started, fault=fault,
                              error=f"{type(exc).__name__}: {exc}", load=[load, os.getloadavg()[0]])
        outcome = _summarise(scenario, run, state, time.perf_counter() - started, fault)
        outcome.load = [load, os.getloadavg()[0]]
        if not state.terminal and state.phase not in ("paused", "awaiting_approval"):
            outcome.phase = "timeout"
        return outcome

    def max_seconds(self) -> float:
        p = self.plan
        planned = p.baseline_seconds + p.shadow_seconds + sum(s.seconds for s in p.steps)
        return 3 * planned + 180

    # ------------------------------------------------------------------ results
    def save(self) -> None:
        out = self.args.out
        data = {"command": " ".join(sys.argv), "machine": machine(), "code": self.code,
                "plan": self.plan.to_json(),
                "traffic": self.traffic, "champion": str(self.art.champion), "model_name": self.art.model_name,
                "data_dir": str(self.art.data_dir), "drill": str(self.art.drill or ""),
                "base_model": str(self.art.base_model or ""), "versions": self.registry.versions,
                "scenario_seconds": self.scenario_seconds, "notes": self.notes,
                "runs": [asdict(o) for o in self.outcomes]}
        (out / "runs.json").write_text(json.dumps(data, indent=1, default=str))
        (out / "table.md").write_text(markdown(self.outcomes, self.scenario_seconds, self.plan, self.notes))


# ----------------------------------------------------------------------------- the table
def _share(n: int, k: int) -> str:
    return f"{n}/{k}"


def markdown(outcomes: list[RunOutcome], scenario_seconds: dict[str, float], plan, notes: list[str]) -> str:
    by: dict[str, list[RunOutcome]] = {}
    for o in outcomes:
        by.setdefault(o.scenario, []).append(o)
    rows = ["| scenario | K | promoted | rolled back | paused | timeout/error | result | gates failed at the deciding "
            "look, inconclusive for a pause (runs) | decided at (runs) | min per rollout (median, max) | "
            "scenario min | load (1-min, range) |",
            "|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|---|"]
    for name in SCENARIOS:
        runs = by.get(name)
        if not runs:
            continue
        k = len(runs)
        count = Counter(o.phase for o in runs)
        other = k - count["promoted"] - count["rolled_back"] - count["paused"]
        if name == "aa":
            result = (f"false rollbacks {_share(count['rolled_back'], k)}, false pauses "
                      f"{_share(count['paused'], k)}")
        else:
            result = (f"detected {_share(count['rolled_back'], k)} (rolled back), held "
                      f"{_share(count['paused'], k)} (paused), missed {_share(count['promoted'], k)}")
        gates = Counter(g for o in runs if o.phase != "promoted" for g in (o.fired or o.inconclusive))
        where = Counter(o.decided_at or o.phase for o in runs if o.phase != "promoted")
        minutes = [o.seconds / 60 for o in runs]
        rows.append(f"| {TITLES[name]} | {k} | {count['promoted']} | {count['rolled_back']} | {count['paused']} | "
                    f"{other} | {result} | {', '.join(f'{g} ({n})' for g, n in gates.most_common()) or '–'} | "
                    f"{', '.join(f'{w} ({n})' for w, n in where.most_common()) or '–'} | "
                    f"{statistics.median(minutes):.1f}, {max(minutes):.1f} | "
                    f"{scenario_seconds.get(name, sum(o.seconds for o in runs)) / 60:.1f} | {_load_range(runs)} |")
    total = sum(scenario_seconds.values()) / 60
    text = ["\n".join(rows), "",
            f"Total: {len(outcomes)} rollouts in {total:.1f} min (scenario minutes include starting its replicas).",
            "", f"Plan: {describe_plan(plan)}."]
    if notes:
        text += [""] + [f"- {n}" for n in notes]
    text += ["", gate_table(by)]
    return "\n".join(text) + "\n"


def _load_range(runs: list[RunOutcome]) -> str:
    loads = [x for o in runs for x in o.load]
    return f"{min(loads):.1f}–{max(loads):.1f}" if loads else "–"


def describe_plan(plan) -> str:
    steps = " → ".join(f"{s.weight:g}% {s.seconds:g} s (≥ {s.min_requests} requests)" for s in plan.steps)
    g = plan.gates
    return (f"baseline {plan.baseline_seconds:g} s (≥ {plan.baseline_min_pairs} pairs), shadow "
            f"{plan.shadow_seconds:g} s (≥ {plan.shadow_min_pairs} pairs), canary {steps}, "
            f"{plan.max_extensions} extension(s), alpha {g.alpha:g} / {plan.planned_looks + plan.max_extensions} "
            f"looks per gate; 5xx ≤ +{g.max_error_rate_increase:g}, TTFT/ITL ≤ ×{g.max_ttft_ratio:g}/"
            f"×{g.max_itl_ratio:g}, ms/token p95 ≤ ×{g.max_ms_per_token_p95_ratio:g}, agreement ≤ "
            f"+{g.max_agreement_drop:g}, probes {plan.probes.tasks} tasks + {plan.probes.safety} safety (accuracy, "
            f"refusals ≤ +{g.max_accuracy_drop:g}, +{g.max_refusal_drop:g}), eval record "
            f"{'required' if g.require_eval_record else 'optional'}")


def gate_table(by: dict[str, list[RunOutcome]]) -> str:
    """Every verdict of every analysis, counted per scenario, gate and phase: pass / inconclusive / fail, and the
    range of the measured values (ratios for latency gates, rates for the others)."""
    rows = ["| scenario | phase | gate | pass | inconclusive | fail | candidate value (min–median–max) | "
            "smallest p |", "|---|---|---|---:|---:|---:|---|---:|"]
    for name in SCENARIOS:
        counts: dict[tuple[str, str], Counter] = {}
        values: dict[tuple[str, str], list[float]] = {}
        pvals: dict[tuple[str, str], list[float]] = {}
        for o in by.get(name, []):
            for a in o.analyses:
                where = a["phase"] + (f" {a['weight']:g}%" if a["weight"] else "")
                for v in a["verdicts"]:
                    key = (where, v["gate"])
                    counts.setdefault(key, Counter())[v["outcome"]] += 1
                    if isinstance(v["candidate"], (int, float)):
                        values.setdefault(key, []).append(float(v["candidate"]))
                    if isinstance(v["p_value"], (int, float)):
                        pvals.setdefault(key, []).append(float(v["p_value"]))
        for (where, gate), c in counts.items():
            vals = values.get((where, gate), [])
            span = f"{min(vals):.3g}–{statistics.median(vals):.3g}–{max(vals):.3g}" if vals else "–"
            p = f"{min(pvals[(where, gate)]):.2g}" if pvals.get((where, gate)) else "–"
            rows.append(f"| {name} | {where} | {gate} | {c['pass']} | {c['inconclusive']} | {c['fail']} | {span} | "
                        f"{p} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- plumbing
def machine() -> str:
    model = ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs ({model or 'unknown model'}), load average {load}"


def code_version() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--short", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + (f" with uncommitted changes to {', '.join(dirty[1::2])}" if dirty else "")


def quiet() -> None:
    from artifacts.common.quiet import quiet_warnings

    quiet_warnings()
    import mlflow  # noqa: F401 - configures its loggers on import; then they are turned down

    for name in ("mlflow", "alembic", "httpx", "serving.rollout", "matplotlib"):
        logging.getLogger(name).setLevel(logging.WARNING)


def load_plan(path: Path | None) -> tuple[Any, dict[str, Any]]:
    """(RolloutPlan, traffic) from --plan: a plan file (RolloutPlan fields) or a recipe (its rollout section)."""
    from artifacts.common.config_loader import build_dataclass, read_yaml_mapping
    from serving.rollout.plan import RolloutPlan

    if path is None:
        return build_dataclass(RolloutPlan, DEFAULT_PLAN, key="", source="built-in"), dict(DEFAULT_TRAFFIC)
    data = read_yaml_mapping(path)
    traffic = dict(DEFAULT_TRAFFIC)
    if "rollout" in data:  # a recipe
        traffic.update({k: v for k, v in (data["rollout"].get("traffic") or {}).items() if k in DEFAULT_TRAFFIC})
        return build_dataclass(RolloutPlan, data["rollout"].get("plan") or {}, key="rollout.plan",
                               source=path), traffic
    return build_dataclass(RolloutPlan, data, key="", source=path), traffic


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/rollout_calibration.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="the pipeline's workdir, read only (default: $LIFECYCLE_HOME, else .lifecycle)")
    ap.add_argument("--k", type=int, default=10, help="rollouts per scenario")
    ap.add_argument("--k-regressions", type=int, default=None, help="rollouts per regression scenario; none: --k")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    ap.add_argument("--plan", type=Path, default=None,
                    help="plan YAML (RolloutPlan fields, or a recipe: its rollout.plan and rollout.traffic); "
                         "default: configs/default.yaml's plan, built in")
    ap.add_argument("--champion", default="candidate",
                    help="the champion: an alias in the pipeline's registry (the default run's shipped bundle) or "
                         "a released bundle directory")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "rollout_calibration")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--kv-memory", default="64MiB", help="KV memory per replica (the pipeline fleet's default)")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        ap.error(f"--scenarios: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SCENARIOS)}")
    if args.workdir is None:
        from artifacts.common.workdir import resolve_workdir

        args.workdir = resolve_workdir().root
    args.scenarios = [s for s in SCENARIOS if s in names]  # A/A first: the TTFT drill is sized from it
    if args.k < 1 or (args.k_regressions is not None and args.k_regressions < 1) or args.threads < 1:
        ap.error("--k, --k-regressions and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)

    def on_term(signum, frame) -> None:  # noqa: ANN001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    quiet()
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "controller.log", "w", buffering=1)  # noqa: SIM115 - closed below

    def log(line: str) -> None:
        log_file.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    calibration = None
    try:
        plan, traffic = load_plan(args.plan)
        art = find_artifacts(args.workdir.resolve(), args.champion, set(args.scenarios))
        for line in (f"champion: {art.champion}", f"data: {art.data_dir}",
                     *([f"drill: {art.drill}"] if art.drill else []),
                     *([f"base model: {art.base_model}"] if art.base_model else []),
                     f"plan: {describe_plan(plan)}", f"traffic: {traffic}", f"machine: {machine()}",
                     f"controller lines: {args.out / 'controller.log'}"):
            console.print(line, highlight=False, soft_wrap=True)
        calibration = Calibration(args, art, plan, traffic, log)
        with console.status("starting the gateway and the champion replica"):
            calibration.start()
        ks = {s: (args.k if s == "aa" or args.k_regressions is None else args.k_regressions) for s in args.scenarios}
        columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("rollouts", total=sum(ks.values()))
            for scenario in args.scenarios:
                progress.console.print(f"[bold]{TITLES[scenario]}[/]: {ks[scenario]} rollouts", highlight=False)
                calibration.run_scenario(scenario, ks[scenario], progress, task)
        calibration.save()
        print((args.out / "table.md").read_text())
        console.print(f"written: {args.out / 'runs.json'}, {args.out / 'table.md'}", highlight=False)
        return 0
    except CalibrationError as exc:
        console.print(f"error: {exc}", highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted; stopping the fleet", highlight=False)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave replicas behind
        if calibration is not None:
            if calibration.registry is not None and calibration.outcomes:
                calibration.save()
            calibration.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log_file.close()


if __name__ == "__main__":
    sys.exit(main())
