"""Rollout calibration: how often the rollout judge is wrong, and how often it is right.

Runs real rollouts, in process, with the project's controller, on a local fleet of `lifecycle serve` replicas
behind the gateway (all on 127.0.0.1), with replayed held-out traffic:

- **aa**: A/A. The champion's own bundle, registered again as a new version with the champion's eval record,
  rolled out against the champion through the whole plan. Anything but a promotion is a false alarm: a false
  rollback (a critical gate failed) or a false pause (inconclusive after the extensions, or an advisory gate).
- planted regressions, each one a rollout that must not be promoted:
  **ttft** and **ttft25** (TTFT +50% and +25%: the gateway's delay drill on the canary, that share of the
  baseline's median TTFT in the A/A runs), **itl** (ITL +30% only: the gateway's token drill holds each streamed
  token but the first to a gap of at least 1.3 × the baseline's median inter-token latency; the same TTFT),
  **errors** (5xx +3%: the gateway's abort drill, 3% of canary requests answered 503 and retried on the
  champion, so users never see them), **sampled** (lost sampled accuracy only: the champion's weights bundled
  again with a hotter default temperature in generation_config.json, so its greedy answers are the champion's and
  its sampled ones worse), **sampled-mild** (the same at temperature 1.3: a loss of a few points, a few times the
  gate's tolerance),
  **slice** (a regression in one slice only: the champion's weights with a planted eval record in which one
  slice lost half its good outcomes, a harm category's refusals or else a task slice's answers), **refusals** (the
  drill bundle, `configs/drill-broken-refusals.yaml`, registry alias `drill-candidate`), **accuracy** (the
  pipeline's base model, bundled, with an eval record made from the pipeline's own evaluation of the base
  model), **slow** (the champion's bundle served with the Hugging Face forward, one sequence at a time:
  `--model-impl hf --max-num-seqs 1`).

The adapter scenarios (**adapter-aa**, **adapter-task**, **adapter-ttft25**) roll out LoRA adapter versions inside
the champion's replica, in the adapter's lane at the gateway (``calibration_adapters.py``); **adapter-trained-aa**
and **adapter-refusals** do so with trained adapters on the pipeline's base bundle as champion, apart from the
others:

    .venv/bin/python benchmarks/rollout_calibration.py --k 10 --scenarios adapter-trained-aa,adapter-refusals \
        --champion runs/NAME/bundle-base-*/bundle

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
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    import repo_path  # noqa: F401 - run as a file: the repository first on sys.path (benchmarks/repo_path.py)

from benchmarks.calibration_adapters import ADAPTER_SCENARIOS, AdapterScenarios  # noqa: E402
from benchmarks.calibration_adapters import SERVE_FLAGS as ADAPTER_SERVE_FLAGS  # noqa: E402
from benchmarks.calibration_artifacts import (  # noqa: E402
    MILD_TEMPERATURE,
    Artifacts,
    CalibrationError,
    Registry,
    base_bundle,
    find_artifacts,
    hot_bundle,
    sliced_record,
)
from benchmarks.calibration_outcomes import (  # noqa: E402
    NULL_SCENARIOS,
    SCENARIOS,
    TITLES,
    TRAINED_ADAPTER_SCENARIOS,
    RunOutcome,
    describe_plan,
    markdown,
    summarise,
)
from benchmarks.servers import REPO  # noqa: E402

for _name, _value in {"MLFLOW_DISABLE_TELEMETRY": "true", "MPLBACKEND": "Agg", "TRANSFORMERS_VERBOSITY": "error",
                      "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false",
                      "OMP_WAIT_POLICY": "PASSIVE",
                      "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}.items():  # the controller reads eval records
    os.environ.setdefault(_name, _value)

SLOW_FLAGS = ["--model-impl", "hf", "--max-num-seqs", "1"]
ABORT_PERCENT = 3.0
TTFT_INCREASE = {"ttft": 0.5, "ttft25": 0.25}  # of the baseline's median TTFT, added before forwarding
ITL_INCREASE = 0.3  # the gap floor: (1 + this) × the baseline's median inter-token latency

# The default plan: the rollout section of configs/default.yaml (what `make run` ships), the calibration's subject
DEFAULT_RECIPE = REPO / "configs" / "default.yaml"
DEFAULT_TRAFFIC: dict[str, Any] = {"users": 200, "concurrency": 4, "max_tokens": 40}  # keys the recipe leaves out


# ----------------------------------------------------------------------------- one rollout
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
        self.adapters: AdapterScenarios | None = None

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        from serving.fleet.fleet import Fleet

        old = self.work / "fleet"
        if (old / "fleet.json").is_file():  # a calibration stopped hard before: its processes are ours
            with contextlib.suppress(Exception):
                Fleet(old, self.art.model_name, "").stop_all()
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
        self.fleet = Fleet(self.work / "fleet", self.art.model_name, self.registry.tracking_uri,
                           threads=self.args.threads, kv_memory=self.args.kv_memory)
        with_adapters = any(s in ADAPTER_SCENARIOS for s in self.args.scenarios)
        # adapter slots only when adapters are calibrated: the snapshot scenarios keep the replica they always had
        self.champion = self.fleet.start_replica(self.art.champion, self.registry.versions["champion"], warmup=4,
                                                 serve_flags=ADAPTER_SERVE_FLAGS if with_adapters else ())
        self.fleet.ensure_gateway(champion=self.champion)
        if with_adapters:
            self.adapters = AdapterScenarios(self)
            self.adapters.prepare()

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop_all()

    def _gateway(self):
        from serving.fleet.gateway_client import GatewayAdmin

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
            if scenario in ("aa", "ttft", "ttft25", "itl", "errors"):
                return reg.register("champion-again", art.champion, art.champion / "eval_record.json"), \
                    art.champion, []
            if scenario == "sampled":
                bundle = hot_bundle(art, self.work)
                return reg.register("champion-hot", bundle, bundle / "eval_record.json"), bundle, []
            if scenario == "sampled-mild":
                temperature = self.args.mild_temperature
                bundle = hot_bundle(art, self.work, temperature, f"mild-{temperature:g}")
                self.notes.append(f"sampled-mild: the champion's weights at a default temperature of {temperature:g}")
                return reg.register("champion-mild", bundle, bundle / "eval_record.json"), bundle, []
            if scenario == "slice":
                record = sliced_record(art, self.work)
                return reg.register("champion-slice", art.champion, record), art.champion, []
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
            return {"canary": {"abort_percent": ABORT_PERCENT}}
        if scenario in TTFT_INCREASE:
            return {"canary": {"delay_ms": round(TTFT_INCREASE[scenario] * self.reference_ms("ttft_ms"), 2)}}
        if scenario == "itl":
            return {"canary": {"token_gap_ms": round((1 + ITL_INCREASE) * self.reference_ms("itl_ms"), 2)}}
        return {}

    def reference_ms(self, metric: str) -> float:
        """The baseline's median ``metric`` (ttft_ms, itl_ms) over the A/A runs' canary analyses; without A/A
        runs, the champion's median over 20 s of traffic measured now. What the latency drills are sized from."""
        increase = {"ttft_ms": "TTFT", "itl_ms": "ITL"}[metric]
        values = [a["metrics"][f"baseline.{metric}_p50"] for o in self.outcomes if o.scenario == "aa"
                  for a in o.analyses if f"baseline.{metric}_p50" in a.get("metrics", {})]
        if values:
            ms = statistics.median(values)
            self.notes.append(f"{increase} drills sized from {ms:.2f} ms, the median of the baseline's {increase} p50 "
                              f"over {len(values)} A/A canary analyses")
            return ms

        self._route_champion_only({})
        samples = self.champion_samples(metric, self.art.model_name)
        if not samples:
            raise CalibrationError(f"no {increase} measured for the champion in 20 s of traffic")
        ms = statistics.median(samples)
        self.notes.append(f"{increase} drills sized from {ms:.2f} ms, the champion's median {increase} over "
                          f"{len(samples)} requests (no A/A runs in this calibration)")
        return ms

    def champion_samples(self, metric: str, model: str, lane: str = "") -> list[float]:
        """``metric`` (ttft_ms, itl_ms) of the champion's requests over 20 s of the calibration's traffic to
        ``model`` (an adapter's public name with its ``lane``), after 3 s of warm-up."""
        from serving.fleet.gateway_client import GatewayAdmin
        from serving.rollout.traffic import TrafficGenerator, TrafficSpec

        generator = TrafficGenerator(self.fleet.record.gateway_url, self.fleet.user_key(),
                                     TrafficSpec(data_dir=str(self.art.data_dir), **self.traffic), model=model).start()
        try:
            time.sleep(3)
            since = time.time()
            time.sleep(20)
            gateway = GatewayAdmin(self.fleet.record.gateway_url, self.fleet.admin_key(), lane=lane)
            try:
                window = gateway.window(since, time.time())
            finally:
                gateway.close()
        finally:
            generator.stop()
        return [x for r in window["variants"] if r["variant"] == "champion" for x in r[metric]]

    def run_scenario(self, scenario: str, k: int, progress, task) -> None:

        if scenario in ADAPTER_SCENARIOS:
            self.adapters.run_scenario(scenario, k, progress, task)
            return
        started = time.perf_counter()
        version, bundle, flags = self.candidate_for(scenario)
        progress.update(task, description=f"{scenario}: starting candidate v{version} and baseline replicas")
        candidate, baseline = self.fleet.start_rollout_replicas(bundle, version, self.champion, serve_flags=flags)
        fault = self.fault_for(scenario)
        self._route_champion_only(fault)
        try:
            self.rollouts_under_traffic(scenario, k, self.art.model_name, progress, task, lambda i: self.one_rollout(
                scenario, i, version, candidate, baseline, fault, progress, task))
        finally:
            self._route_champion_only({})
            self.fleet.stop_replica(candidate)
            self.fleet.stop_replica(baseline)
            self.scenario_seconds[scenario] = time.perf_counter() - started

    def rollouts_under_traffic(self, scenario: str, k: int, model: str, progress, task, one_rollout) -> None:
        """``k`` rollouts (``one_rollout(run)`` each) while the calibration's traffic goes to ``model``."""
        from serving.rollout.traffic import TrafficGenerator, TrafficSpec

        generator = TrafficGenerator(self.fleet.record.gateway_url, self.fleet.user_key(),
                                     TrafficSpec(data_dir=str(self.art.data_dir), **self.traffic), model=model).start()
        try:
            for i in range(1, k + 1):
                progress.update(task, description=f"{scenario} {i}/{k}")
                self.record(scenario, i, k, one_rollout(i), progress, task)
        finally:
            stats = generator.stop()
            self.log(f"[{scenario}] traffic: {stats.sent} requests, statuses {dict(stats.statuses)}, by variant "
                     f"{dict(stats.variants)}, errors seen by users {stats.user_errors}")

    def record(self, scenario: str, run: int, k: int, outcome: RunOutcome, progress, task) -> None:
        self.outcomes.append(outcome)
        progress.advance(task)
        detail = f" at {outcome.decided_at}" if outcome.decided_at else ""
        gates = outcome.fired or outcome.inconclusive
        why = f" ({', '.join(gates)})" if gates and outcome.phase != "promoted" else ""
        progress.console.print(f"  {scenario} {run}/{k}: {outcome.phase}{detail}{why} in "
                               f"{outcome.seconds / 60:.1f} min", highlight=False)
        self.save()

    def one_rollout(self, scenario: str, run: int, version: str, candidate, baseline, fault: dict, progress,
                    task) -> RunOutcome:
        from dataclasses import replace

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
        return self.drive(scenario, run, spec, fault, progress, task)

    def drive(self, scenario: str, run: int, spec, fault: dict, progress, task) -> RunOutcome:
        """One rollout of ``spec`` by the project's controller, to its end (or a pause), as a RunOutcome."""
        from serving.rollout.controller import Controller

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
        outcome = summarise(scenario, run, state, time.perf_counter() - started, fault)
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

    path = path or DEFAULT_RECIPE
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
    ap.add_argument("--scenarios", default=",".join(s for s in SCENARIOS if s not in TRAINED_ADAPTER_SCENARIOS),
                    help="comma-separated, of: " + ", ".join(SCENARIOS) + " (default: all but the trained adapter "
                         "ones, which need --champion the base's bundle and run apart)")
    ap.add_argument("--plan", type=Path, default=None,
                    help="plan YAML (RolloutPlan fields, or a recipe: its rollout.plan and rollout.traffic); "
                         "default: configs/default.yaml's")
    ap.add_argument("--champion", default="candidate",
                    help="the champion: an alias in the pipeline's registry (the default run's shipped bundle) or "
                         "a released bundle directory")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "rollout_calibration")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--kv-memory", default="64MiB", help="KV memory per replica (the pipeline fleet's default)")
    ap.add_argument("--mild-temperature", type=float, default=MILD_TEMPERATURE,
                    help="the sampled-mild scenario's default temperature (the champion's is 1.0)")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        ap.error(f"--scenarios: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SCENARIOS)}")
    if args.workdir is None:
        from artifacts.common.workdir import resolve_workdir

        args.workdir = resolve_workdir().root
    args.scenarios = [s for s in SCENARIOS if s in names]  # A/A first: the latency drills are sized from it
    trained = [s for s in args.scenarios if s in TRAINED_ADAPTER_SCENARIOS]
    if trained and len(trained) != len(args.scenarios):
        ap.error(f"--scenarios: {', '.join(trained)} run on the base's bundle as champion, with adapters of their "
                 "own: run them apart from the others")
    if args.k < 1 or (args.k_regressions is not None and args.k_regressions < 1) or args.threads < 1:
        ap.error("--k, --k-regressions and --threads must be >= 1")
    if not args.mild_temperature > 0:
        ap.error(f"--mild-temperature: must be > 0, got {args.mild_temperature:g}")
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
        ks = {s: (args.k if s in NULL_SCENARIOS or args.k_regressions is None else args.k_regressions)
              for s in args.scenarios}
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
