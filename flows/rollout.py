"""The rollout as Prefect flows: one that drives a persisted rollout to its end (what `deploy` starts in the
background), and the pipeline's last stage, which rolls the new candidate out on a local fleet.

The controller itself lives in ``serving.rollout``; these flows add what orchestration gives: a flow run per
rollout in the Prefect UI with its timeline and gate table as artifacts, and the fleet's lifetime around it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from rich.console import Console

if TYPE_CHECKING:  # the recipe's modules bring torch and transformers, which a background controller never needs
    from flows.recipe import RolloutSection

console = Console(stderr=True)
# on a version whose pipeline rollout stopped unfinished: the command that rolls it out on the deploy fleet
RESTART_TAG = "rollout.restart_with"


def _say(line: str) -> None:
    console.print(line, highlight=False)


def _artifact_key(text: str) -> str:
    return "rollout-" + "".join(c if c.isalnum() else "-" for c in text.lower())[:90]


@flow(name="rollout", log_prints=True, validate_parameters=False)
def rollout_flow(rollout_dir: str, max_seconds: float | None = None) -> dict[str, Any]:
    """Drive the rollout persisted in ``rollout_dir`` until it is promoted or rolled back (resumes one
    a killed process left), then retire the replicas no variant routes to."""
    from serving.rollout import Controller
    from serving.rollout.report import rollout_markdown

    controller = Controller(rollout_dir, say=_say)
    try:
        state = controller.run_until_done(max_seconds)
    finally:
        controller.close()
    _retire(state)
    create_markdown_artifact(markdown=rollout_markdown(rollout_dir), key=_artifact_key(state.id),
                             description=f"rollout of v{state.spec.candidate_version}: {state.phase}")
    return {"id": state.id, "phase": state.phase, "reason": state.reason, "mlflow_run_id": state.mlflow_run_id}


def _retire(state) -> None:
    if not state.terminal or not state.spec.fleet_dir:
        return
    if state.spec.lane:  # an adapter's rollout: the version that lost leaves the base's replicas, which stay
        from serving.rollout.adapter_lane import retire_adapter

        unloaded = retire_adapter(state)
        if unloaded:
            console.print(f"unloaded {unloaded} from the base's replicas", highlight=False)
        return
    from serving.fleet import Fleet

    fleet = Fleet(state.spec.fleet_dir, state.spec.model_name, state.spec.tracking_uri)
    for replica in fleet.retire_unrouted():
        console.print(f"retired the replica of v{replica.version} ({replica.url})", highlight=False)


# ----------------------------------------------------------------------------- the pipeline's rollout stage
@dataclass
class RolloutOutcome:
    version: str
    result: str  # promoted | rolled_back | paused | awaiting_approval | champion-installed | already-champion |
    #              decided-before (rolled back, paused or awaiting approval at an earlier run) | manual
    lines: list[str] = field(default_factory=list)
    mlflow_run_id: str | None = None


@flow(name="release-rollout", log_prints=True, validate_parameters=False)
def pipeline_rollout(section: RolloutSection, model_name: str, version: str, bundle: str, data_dir: str,
                     tracking_uri: str, fleet_dir: str, eval_passed: bool | None = None,
                     first_champion: tuple[str, str] | None = None) -> RolloutOutcome:
    """Roll the pipeline's new candidate out against the current champion on a local fleet, with replayed
    held-out traffic; the fleet stops when the rollout ends (the registry keeps the verdict).

    ``first_champion`` (version, bundle): where no champion exists yet, install this one first (the full
    precision build of the same model) and roll the candidate out against it, so the very first run already
    checks online, in front of traffic, what the fidelity report predicts offline for the 4-bit candidate."""
    from serving.rollout import RegistryConsole

    registry = RegistryConsole(model_name, tracking_uri)
    champion = registry.alias_version("champion")
    if champion == version:
        line = f"version {version} is already champion; nothing to roll out"
        console.print(f"[green]✓ rollout[/] {line}", highlight=False)
        return RolloutOutcome(version, "already-champion", [line])
    decided = decided_before(registry, version, champion, data_dir)
    if decided is not None:
        return decided
    if section.mode == "manual":
        line = (f"v{version} is `candidate`; roll it out with: deploy snapshot models:/{model_name}/{version} "
                f"--probes {data_dir} --wait")
        console.print(f"[yellow]- rollout[/] manual: {line}", highlight=False)
        return RolloutOutcome(version, "manual", [line])
    fleet = rehearsal_fleet(section, fleet_dir, model_name, tracking_uri)
    try:
        lines: list[str] = []
        if champion is None and first_champion is not None and first_champion[0] != version:
            installed = install_first(fleet, model_name, first_champion[0], first_champion[1], tracking_uri)
            lines, champion = installed.lines, first_champion[0]
        if champion is None:
            return install_first(fleet, model_name, version, bundle, tracking_uri)
        outcome = _roll_out(section, fleet, model_name, version, champion, bundle, data_dir, tracking_uri,
                            eval_passed)
        outcome.lines[:0] = lines
        return outcome
    finally:
        fleet.stop_all()
        console.print(f"[dim]{fleet.record.backend} fleet stopped[/]", highlight=False)


def rehearsal_fleet(section: RolloutSection, fleet_dir: str, model_name: str, tracking_uri: str):
    """The pipeline's rehearsal fleet as the recipe's ``rollout.fleet`` section describes it, connected (a Ray
    cluster that does not answer ends the stage here, before anything starts); the caller stops it."""
    from serving.fleet import Fleet

    record_file = Path(fleet_dir) / "fleet.json"
    if record_file.is_file():
        old = Fleet.read(fleet_dir)
        if old.model_name != model_name and not old.replicas and not old.gateway_pid:
            # every stage stops its rehearsal fleet: a stopped one of another model (the recipe's
            # registry.model_name changed between runs) is history, not a fleet to refuse to mix with
            record_file.unlink()
    f = section.fleet
    fleet = Fleet(fleet_dir, model_name, tracking_uri, backend=f.backend, ray_address=f.ray_address or None,
                  gateway_port=f.gateway_port or None, threads=f.threads, kv_memory=f.kv_memory,
                  other_gateways=f.gateways)
    fleet.connect()
    return fleet


def decided_before(registry, version: str, champion: str | None, data_dir: str) -> RolloutOutcome | None:
    """A version whose rollout was rolled back, paused or left awaiting approval by an earlier run: that verdict
    stands, and a paused rehearsal is not rehearsed again on the same data: a person decides (the outcome's line
    says how to roll it out by hand). None for a version no rollout has judged."""
    tags = registry.tags(version)
    state = tags.get("rollout.state", "")
    if not (state == "rolled back" or state == "paused" or state.startswith("awaiting approval")):
        return None
    restart = tags.get(RESTART_TAG) or \
        f"deploy snapshot models:/{registry.model_name}/{version} --probes {data_dir} --wait"
    line = (f"v{version}'s rollout against v{champion} is {state} ({tags.get('rollout.reason', 'see its run')}); "
            f"not rolled out again by a re-run; to roll it out by hand: {restart}")
    console.print(f"[yellow]- rollout[/] {line}", highlight=False)
    return RolloutOutcome(version, "decided-before", [line], tags.get("rollout.run"))


def install_first(fleet, model_name: str, version: str, bundle: str, tracking_uri: str,
                  serve_flags: tuple[str, ...] = ()) -> RolloutOutcome:
    """No champion yet: ``version`` becomes the model's first champion on the rehearsal fleet after a smoke check
    (``serve_flags``: its replica's extra flags, adapter slots say)."""
    from serving.rollout import install_on_fleet

    console.print(f"[bold cyan]▶ rollout[/] no champion yet: v{version} becomes champion after a smoke check",
                  highlight=False)
    result = install_on_fleet(fleet, model_name=model_name, version=version, bundle=bundle,
                              tracking_uri=tracking_uri, cause="first champion: no champion before",
                              actor="lifecycle pipeline", first=True, serve_flags=serve_flags)
    line = f"{model_name} v{version} is champion (first champion, smoke check passed; MLflow run {result['run_id']})"
    console.print(f"[green]✓ rollout[/] {line}", highlight=False)
    return RolloutOutcome(version, "champion-installed", [line], result["run_id"])


def _roll_out(section: RolloutSection, fleet, model_name: str, version: str, champion: str, bundle: str,
              data_dir: str, tracking_uri: str, eval_passed: bool | None) -> RolloutOutcome:
    from serving.rollout import start_rollout

    plan = rehearsal_plan(section, data_dir)
    console.print(f"[bold cyan]▶ rollout[/] v{version} against champion v{champion}: starting the "
                  f"{fleet.record.backend} fleet",
                  highlight=False)
    controller = start_rollout(fleet, model_name=model_name, version=version, bundle=bundle, champion=champion,
                               tracking_uri=tracking_uri, plan=plan, eval_passed=eval_passed, say=_say)
    return drive_rehearsal(section, fleet, controller, data_dir, model_name)


def rehearsal_plan(section: RolloutSection, data_dir: str):
    """The recipe's rollout plan, its probes drawn from the pipeline's held-out data unless it names its own."""
    plan = section.plan
    if not plan.probes.data_dir:
        plan = replace(plan, probes=replace(plan.probes, data_dir=data_dir))
    return plan


def drive_rehearsal(section: RolloutSection, fleet, controller, data_dir: str, model: str) -> RolloutOutcome:
    """Drive a started rollout to its verdict on the rehearsal fleet, under replayed held-out traffic for
    ``model`` (a snapshot's model name, or an adapter's lane); a pause ends it unfinished, with the command that
    rolls the version out on the deploy fleet in its lines and on the version's registry tags."""
    from serving.rollout import RegistryConsole, report
    from serving.rollout.resumable import restart_command
    from serving.rollout.traffic import TrafficGenerator, TrafficSpec

    directory, url = controller.files.dir, controller.state.spec.gateway_url
    spec = controller.state.spec
    version, model_name = spec.candidate_version, spec.model_name
    t = section.traffic
    traffic = TrafficGenerator(url, fleet.user_key(), TrafficSpec(
        data_dir=data_dir, users=t.users, concurrency=t.concurrency, max_tokens=t.max_tokens,
        stream_fraction=t.stream_fraction, temperature=t.temperature, requests_per_second=t.requests_per_second),
        model=model).start()
    started = time.perf_counter()
    try:
        # a pipeline run does not wait for a person: a pause ends the stage, the rollout stays resumable
        state = controller.run_until_done(stop_when_waiting=True)
    finally:
        controller.close()
        stats = traffic.stop()
    lines = report.timeline_lines(state)
    lines.append(f"traffic: {stats.sent} requests from {t.users} users, {stats.user_errors} errors seen by users, "
                 f"by variant {dict(stats.variants)}; {time.perf_counter() - started:.0f} s")
    if not state.terminal:
        # the rehearsal fleet stops with this stage (no replayed traffic would come after it), so this rollout
        # cannot be resumed: say, here and on the version in the registry, what rolls it out on the deploy fleet
        restart = restart_command(directory, state)
        RegistryConsole(model_name, spec.tracking_uri).set_tags(version, {RESTART_TAG: restart})
        lines.append(f"{state.phase}: {state.reason}")
        lines.append(f"this rehearsal's fleet stops with the stage; to put v{version} in front of users under the "
                     f"same plan: {restart} (a pause there goes on with `deploy resume`, or `deploy resume --waive "
                     "GATE`)")
    create_markdown_artifact(markdown=report.rollout_markdown(directory), key=_artifact_key(state.id),
                             description=f"rollout of {model_name} v{version}: {state.phase}")
    mark = "[green]✓" if state.phase == "promoted" else "[red]✗" if state.phase == "rolled_back" else "[yellow]…"
    console.print(f"{mark} rollout[/] {model_name} v{version}: {state.phase}" +
                  (f" ({state.reason})" if state.reason else ""), highlight=False)
    return RolloutOutcome(version, state.phase, lines, state.mlflow_run_id)
