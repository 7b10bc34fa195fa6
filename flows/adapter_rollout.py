"""The adapter form's rollout stage: the new adapter version in front of replayed traffic, in its lane of a
rehearsal fleet of its base, judged by the same plan and gates as a snapshot's rollout (docs/pipeline.md, "The
adapter release form").

A rehearsal fleet of the base serves the base with adapter slots; the base becomes its model's first champion
when it has none. The adapter's first version becomes its lane's champion after a smoke check; a later one is
rolled out against the champion adapter in the same replicas, where both sides share every batch, so the champion
adapter is the canary's baseline. The fleet stops when the stage ends and the registry keeps the verdict, as in
the merged form (``flows.rollout.pipeline_rollout``). Where the base model's champion is another snapshot than
this adapter's base, an adapter cannot serve on it: the stage prints the ``deploy`` commands instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import flow

from flows.rollout import (
    RolloutOutcome,
    console,
    decided_before,
    drive_rehearsal,
    install_first,
    rehearsal_fleet,
    rehearsal_plan,
)

if TYPE_CHECKING:
    from flows.recipe import RolloutSection
    from flows.stage_runner import StageOutput
    from flows.stage_tasks import PipelineContext

ACTOR = "lifecycle pipeline"
MAX_LORAS = 4


@dataclass(frozen=True)
class AdapterRelease:
    """What the adapter form's release registered: the base snapshot (model, version, bundle) and the adapter
    version bound to it (model, version, bundle, rank)."""

    base_model: str
    base_version: str
    base_bundle: str
    adapter_model: str
    version: str
    bundle: str
    rank: int

    @property
    def base_uri(self) -> str:
        return f"models:/{self.base_model}/{self.base_version}"

    @property
    def adapter_uri(self) -> str:
        return f"models:/{self.adapter_model}/{self.version}"

    @property
    def slots(self) -> tuple[str, ...]:
        """The base replica's adapter slots: a few adapters, each of the stacked rank (the stages' ranks summed,
        48 for three rank-16 stages), never below the engine's default rank."""
        return ("--max-loras", str(MAX_LORAS), "--max-lora-rank", str(max(16, self.rank)))


def adapter_rollout_stage(ctx: PipelineContext, release: StageOutput, data: StageOutput) -> RolloutOutcome | None:
    """The adapter form's last stage (recipe ``rollout.mode``); never cached: it acts on the world."""
    if ctx.recipe.rollout.mode == "off" or "version" not in release.info:
        return None
    if "alias" not in release.info:
        line = f"{release.info['model_uri']} failed its gates ({release.info['gates']}); nothing to roll out"
        console.print(f"[yellow]- rollout[/] {line}", highlight=False)
        return RolloutOutcome(str(release.info["version"]), "gates-failed", [line])
    from artifacts.adapter_bundle import read_adapter_manifest

    adapter = AdapterRelease(
        base_model=ctx.recipe.registered_model_name, base_version=str(release.info["base_version"]),
        base_bundle=release.info["base_bundle"], adapter_model=ctx.recipe.adapter_model_name,
        version=str(release.info["version"]), bundle=release.path,
        rank=read_adapter_manifest(release.path).lora.rank)
    return pipeline_adapter_rollout(ctx.recipe.rollout, adapter, data.path, ctx.workdir.tracking_uri(),
                                    str(ctx.workdir.runs / ctx.recipe.name / "fleet"), str(ctx.workdir.deployments))


@flow(name="adapter-release-rollout", log_prints=True, validate_parameters=False)
def pipeline_adapter_rollout(section: RolloutSection, adapter: AdapterRelease, data_dir: str, tracking_uri: str,
                             fleet_dir: str, deployments: str) -> RolloutOutcome:
    """Roll ``adapter`` out in its lane on a rehearsal fleet of its base (see the module's docstring)."""
    from serving.rollout import RegistryConsole

    adapters = RegistryConsole(adapter.adapter_model, tracking_uri)
    champion = adapters.alias_version("champion")
    if champion == adapter.version:
        line = f"{adapter.adapter_uri} is already champion; nothing to roll out"
        console.print(f"[green]✓ rollout[/] {line}", highlight=False)
        return RolloutOutcome(adapter.version, "already-champion", [line])
    decided = decided_before(adapters, adapter.version, champion, data_dir)
    if decided is not None:
        return decided
    base_champion = RegistryConsole(adapter.base_model, tracking_uri).alias_version("champion")
    champion_base = _base_version_of(adapter.adapter_model, champion, tracking_uri)
    if section.mode == "manual" or base_champion not in (None, adapter.base_version) or \
            champion_base not in (None, adapter.base_version):
        return _by_hand(adapter, base_champion, data_dir, manual=section.mode == "manual",
                        champion=(champion, champion_base))
    fleet = rehearsal_fleet(section, fleet_dir, adapter.base_model, tracking_uri)
    try:
        lines: list[str] = []
        if base_champion is None:
            lines += install_first(fleet, adapter.base_model, adapter.base_version, adapter.base_bundle,
                                   tracking_uri, serve_flags=adapter.slots).lines
        outcome = _roll_out_in_lane(section, fleet, adapter, champion, data_dir, tracking_uri, Path(deployments))
        outcome.lines[:0] = lines
        return outcome
    finally:
        fleet.stop_all()
        console.print(f"[dim]{fleet.record.backend} fleet stopped[/]", highlight=False)


def _roll_out_in_lane(section: RolloutSection, fleet, adapter: AdapterRelease, champion: str | None,
                      data_dir: str, tracking_uri: str, deployments: Path) -> RolloutOutcome:
    """The base's replica (with slots) serving, the new version loaded into it; then either its first install or
    its rollout against the champion adapter, loaded beside it."""
    from serving.rollout import RegistryConsole
    from serving.rollout.adapter_lane import (
        install_adapter,
        load_adapter,
        serve_champion_adapter,
        served_name,
        start_adapter_rollout,
    )

    public = adapter.adapter_model  # the adapter bundle's name: the lane users name in `model`
    replica = fleet.start_replica(adapter.base_bundle, adapter.base_version, serve_flags=adapter.slots)
    fleet.ensure_gateway(champion=replica)
    load_adapter(replica.url, served_name(public, adapter.version), adapter.bundle, fleet.admin_key())
    adapters = RegistryConsole(adapter.adapter_model, tracking_uri)
    if champion is None:
        console.print(f"[bold cyan]▶ rollout[/] {adapter.adapter_model} has no champion yet: v{adapter.version} "
                      "becomes champion after a smoke check", highlight=False)
        install_adapter(fleet, adapters, public, adapter.version, None, ACTOR, "first champion of the adapter")
        line = (f"{adapter.adapter_uri} is champion (first champion of the adapter, smoke check passed), served as "
                f"model {public!r} on its base {adapter.base_uri}")
        console.print(f"[green]✓ rollout[/] {line}", highlight=False)
        return RolloutOutcome(adapter.version, "champion-installed", [line])
    champion_served = serve_champion_adapter(fleet, replica.url, adapter.adapter_model, public, champion,
                                             tracking_uri, deployments, ACTOR)
    console.print(f"[bold cyan]▶ rollout[/] {adapter.adapter_uri} against champion v{champion}, in the lane "
                  f"{public!r} of a {fleet.record.backend} fleet of {adapter.base_uri}", highlight=False)
    controller = start_adapter_rollout(fleet, adapter_model=adapter.adapter_model, public=public,
                                       version=adapter.version, champion=champion, champion_served=champion_served,
                                       tracking_uri=tracking_uri, plan=rehearsal_plan(section, data_dir),
                                       eval_passed=True, say=lambda line: console.print(line, highlight=False))
    return drive_rehearsal(section, fleet, controller, data_dir, model=public)


def _base_version_of(adapter_model: str, version: str | None, tracking_uri: str) -> str | None:
    """The base version a registered adapter version was trained on (None for no version)."""
    if version is None:
        return None
    from artifacts.adapter_registry import adapter_base

    return adapter_base(adapter_model, version, tracking_uri)[1]


def _by_hand(adapter: AdapterRelease, base_champion: str | None, data_dir: str, manual: bool,
             champion: tuple[str | None, str | None] = (None, None)) -> RolloutOutcome:
    """The ``deploy`` commands that roll the adapter out: what ``rollout.mode: manual`` asks for, and all the
    pipeline can offer when the base model's champion is another snapshot (an adapter serves only on its base), or
    when the champion adapter was trained on another base than this one (the two cannot share a replica, so no
    canary can compare them)."""
    slots = " ".join(adapter.slots)
    lines = []
    champion_version, champion_base = champion
    if champion_base not in (None, adapter.base_version):
        lines.append(f"the champion {adapter.adapter_model} v{champion_version} was trained on {adapter.base_model} "
                     f"v{champion_base}, this version on v{adapter.base_version}: no replica serves both, so no "
                     "canary compares them: once its base serves, it replaces the champion on its release gates")
    if base_champion is None:
        lines.append(f"its base {adapter.base_uri} must serve first: deploy snapshot {adapter.base_uri} {slots} "
                     "--wait")
    elif base_champion != adapter.base_version:
        lines.append(f"its base {adapter.base_uri} is not {adapter.base_model}'s champion (v{base_champion}); an "
                     f"adapter serves only on its own base: roll the base out first (deploy snapshot "
                     f"{adapter.base_uri} {slots} --wait), or register the adapter form's base under a model of its "
                     "own (registry.model_name) and serve it from a fleet of its own (deploy --fleet)")
    else:
        lines.append(f"its base {adapter.base_uri} is champion; its replicas need adapter slots of rank ≥ "
                     f"{adapter.rank} (deployed with {slots})")
    if champion_base not in (None, adapter.base_version):
        lines.append(f"{adapter.adapter_uri} is `candidate`; install it in its lane with: deploy snapshot "
                     f"{adapter.adapter_uri} --as champion")
    else:
        lines.append(f"{adapter.adapter_uri} is `candidate`; roll it out in its lane with: deploy snapshot "
                     f"{adapter.adapter_uri} --probes {data_dir} --wait")
    how = "manual" if manual else "by hand"
    for line in lines:
        console.print(f"[yellow]- rollout[/] adapter form, {how}: {line}", highlight=False)
    return RolloutOutcome(adapter.version, "manual", lines)
