"""What MLflow shows of a rollout, written after every transition and analysis.

The registry's version rows carry short tags (``rollout.state``, ``rollout.reason``, ``rollout.verdict``,
``rollout.vs_champion``); the rollout's own run carries the same as run tags, each analysis as a step of
metrics, and the artifacts a person reads (decision log, timeline, comparison table and plot, the top
disagreements), rendered by ``report.py``. Plain functions of the persisted state.
"""

from __future__ import annotations

from collections.abc import Callable

from serving.rollout import report
from serving.rollout import state as S
from serving.rollout.analysis import Analysis
from serving.rollout.registry_console import RegistryConsole
from serving.rollout.state import RolloutState
from serving.rollout.tracking import RolloutRun


def start_run(run: RolloutRun, state: RolloutState) -> str:
    """Open the rollout's run: the plan as params, who is compared with whom as tags. Returns its id."""
    spec = state.spec
    return run.start(f"{spec.model_name} v{spec.candidate_version} vs v{spec.champion_version}",
                     {"model": spec.model_name, "candidate_version": spec.candidate_version,
                      "champion_version": spec.champion_version, "start": spec.start, **spec.plan.flat_params()},
                     {"rollout.id": state.id, "rollout.status": "running", "rollout.candidate": spec.candidate_version,
                      "rollout.champion": spec.champion_version})


def tag_versions(console: RegistryConsole, run: RolloutRun, state: RolloutState) -> None:
    """Where the rollout stands, on the candidate's version row (and the champion's once it is replaced)."""
    spec = state.spec
    phase = state.phase
    label = {S.CANARY: f"canary {state.weight:g}%", S.AWAITING_APPROVAL: f"awaiting approval at {state.weight:g}%",
             S.PAUSED: "paused", S.BAKE: "promoted (baking)", S.ROLLED_BACK: "rolled back",
             S.BASELINE: "shadow (measuring floor)"}.get(phase, phase)
    tags = {"rollout.state": label}
    if state.reason and phase in (S.PAUSED, S.ROLLED_BACK, S.AWAITING_APPROVAL):
        tags["rollout.reason"] = state.reason[:240]
    console.set_tags(spec.candidate_version, tags)
    if phase in (S.BAKE, S.PROMOTED):
        console.set_tags(spec.champion_version, {"rollout.state": "previous champion"})
    run.set_tags({"rollout.status": phase, "rollout.phase": label,
                  **({"rollout.reason": state.reason} if state.reason else {})})


def record_analysis(console: RegistryConsole, run: RolloutRun, state: RolloutState, result: Analysis,
                    say: Callable[[str], None]) -> None:
    """An analysis as a step of metrics and the version's verdict tags; its gate lines to ``say``."""
    spec = state.spec
    run.log_step(result.look, result.metrics)
    console.set_tags(spec.candidate_version, {"rollout.verdict": result.summary[:240],
                                              "rollout.vs_champion": report.vs_champion(state)})
    say(f"analysis {result.look} ({result.phase}{f' {result.weight:g}%' if result.weight else ''}): "
        f"{result.summary}")
    for v in result.verdicts:
        say(f"    {v.gate:<24} {v.outcome:<12} {v.reason}")
    if result.disagreements and result.phase == S.SHADOW:
        run.log_text(report.disagreements_markdown(state, result.disagreements), "disagreements.md")


def write_artifacts(run: RolloutRun, state: RolloutState) -> None:
    """The decision log, the timeline and, once there is an analysis, the comparison table and plot."""
    run.log_json_lines(state.decisions, "decision_log.jsonl")
    run.log_text(report.timeline_markdown(state), "timeline.md")
    if state.analyses:
        run.log_text(report.comparison_markdown(state), "comparison.md")
        import matplotlib.pyplot as plt

        figure = report.comparison_figure(state)
        run.log_png(figure, "comparison.png")
        plt.close(figure)
