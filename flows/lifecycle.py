"""The lifecycle flow: base → data → SFT → DPO → GRPO → (draft) → quantize → bundle → verify → register → evals →
rollout.

Each stage reads the previous stage's output directory and writes its own, so any stage can be re-run,
cached or moved to another machine; this module only decides the order and the MLflow run structure (the
stages and their cache keys are in `flows.stage_tasks`). Stage logic lives in the stage packages. Importing this
module is cheap; heavy imports happen inside the stages.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow
from prefect import flow

from artifacts.common.workdir import sqlite_artifact_root
from flows.adapter_release import release_adapter
from flows.adapter_rollout import adapter_rollout_stage
from flows.environment import resolve_workdir
from flows.notify import notify_failure
from flows.prefect_artifacts import publish_artifacts
from flows.ray_runner import stage_runner
from flows.recipe import load_recipe
from flows.report import PipelineReport, draft_note, quantized_table, stage_change_note
from flows.schedule import current_run_skip_reason
from flows.stage_runner import StageOutput, console
from flows.stage_tasks import (
    PipelineContext,
    advise,
    base_stage,
    bundle_stage,
    data_key,
    data_stage,
    draft_stage,
    eval_stage,
    quantize_stage,
    release_stage,
    rollout_stage,
    training_stage,
)

if TYPE_CHECKING:
    from flows.rollout import RolloutOutcome

# --- the flow --------------------------------------------------------------------------------------------

def _run_name() -> str:
    """`<recipe>-data-<version>`: which recipe, on which data (the data stage's key), at a glance."""
    from prefect.runtime import flow_run

    recipe_path = flow_run.parameters.get("recipe_path", "")
    try:
        recipe = load_recipe(recipe_path)
        return f"{recipe.name}-data-{data_key(recipe.data)[:8]}"
    except Exception:  # noqa: BLE001 - a bad recipe fails the run itself, with its message
        return f"{Path(recipe_path).stem or 'lifecycle'}-unreadable-recipe"


def _run_timeout() -> float | None:
    """A scheduled deployment's time limit (set per deployment by `lifecycle schedule --timeout`)."""
    value = os.environ.get("LIFECYCLE_RUN_TIMEOUT_S")
    return float(value) if value else None


@flow(name="lifecycle", log_prints=True, flow_run_name=_run_name, on_failure=[notify_failure],
      on_crashed=[notify_failure], timeout_seconds=_run_timeout())
def lifecycle(recipe_path: str) -> dict[str, Any]:
    """Run every enabled stage of the recipe; finished stages come from Prefect's cache."""
    from flows import quiet_logs, stop_signals

    quiet_logs.install()  # also when a worker, not `lifecycle run`, started this run
    stop_signals.reclaim()  # `lifecycle run`, not Prefect's engine, decides how a stopped run ends (run_stop.py)
    skipped = _skipped_by_a_pause()
    if skipped:
        return {"skipped": skipped}
    started = time.perf_counter()
    recipe = load_recipe(recipe_path)
    workdir = resolve_workdir(recipe.workdir)
    _configure_threads(recipe.threads)
    mlflow.set_tracking_uri(workdir.tracking_uri())
    _use_experiment(recipe.name)
    report = PipelineReport(recipe_name=recipe.name)

    with mlflow.start_run(run_name=f"{recipe.name}-pipeline") as parent, \
            stage_runner(recipe.runner, workdir.tracking_uri(), str(recipe_path)) as stages:
        mlflow.set_tags({"lifecycle.recipe": str(Path(recipe_path).resolve()), "lifecycle.kind": "pipeline",
                         "lifecycle.runner": stages.kind})
        mlflow.log_artifact(str(recipe_path), artifact_path="recipe")
        ctx = PipelineContext(recipe=recipe, workdir=workdir, parent_run_id=parent.info.run_id, stages=stages)

        base = base_stage(ctx)
        data = data_stage(ctx)
        report.add_stage(base)
        report.add_stage(data)
        report.add_eval("base", eval_stage(ctx, "base", base, data))
        model = _post_train(ctx, report, base, data)
        if recipe.release.form == "adapter":
            rollout = adapter_rollout_stage(ctx, release_adapter(ctx, report, base, data), data)
        else:
            draft = None
            if recipe.draft is not None:
                draft = draft_stage(ctx, model, data)
                report.add_stage(draft)
            releases = _release(ctx, report, model, data)
            if draft is not None:
                report.notes.append(draft_note(draft, releases.get(ctx.ship_variant)))
            rollout = rollout_stage(ctx, releases.get(ctx.ship_variant), data, releases.get("fp"))
        if rollout is not None:
            report.notes.append("rollout:\n\n" + "\n".join(f"    {line}" for line in rollout.lines))

        report.total_seconds = time.perf_counter() - started
        _finish(ctx, report, data, rollout, parent.info.run_id)
        return report.to_dict() | {"mlflow_run_id": parent.info.run_id,
                                   "tracking_uri": workdir.tracking_uri(),
                                   "rollout": None if rollout is None else {
                                       "version": rollout.version, "result": rollout.result,
                                       "lines": rollout.lines, "mlflow_run_id": rollout.mlflow_run_id}}


def _post_train(ctx: PipelineContext, report: PipelineReport, base: StageOutput, data: StageOutput) -> StageOutput:
    """SFT → DPO → GRPO, each enabled one from the previous one's model, evaluated and compared with its input."""
    model, model_label = base, "base"
    for name in ("sft", "dpo", "grpo"):
        if not getattr(ctx.recipe.training, name).enabled:
            console.print(f"[yellow]- {name}[/] disabled in the recipe", highlight=False)
            continue
        model = training_stage(ctx, name, model, data)
        report.add_stage(model)
        report.add_eval(name, eval_stage(ctx, name, model, data))
        report.notes.append(stage_change_note(name, model_label, report.evals[name].metrics,
                                              report.evals[model_label].metrics, model.metrics))
        model_label = name
    return model


def _release(ctx: PipelineContext, report: PipelineReport, model: StageOutput,
             data: StageOutput) -> dict[str, StageOutput]:
    """The final model and each quantized variant of it: bundled, evaluated, released; the release per variant."""
    model_variants: dict[str, tuple[str, StageOutput, str | None]] = {"fp": (model.path, model, None)}
    if ctx.recipe.quantize is not None:
        quantized = quantize_stage(ctx, model, data)
        report.add_stage(quantized)
        report.notes.append("quantization fidelity:\n\n" + quantized.info.get("fidelity_table", ""))
        for method, path in quantized.info["outputs"].items():
            model_variants[method] = (path, quantized, quantized.info.get("calibration_digest"))

    releases: dict[str, StageOutput] = {}
    for variant, (path, upstream, calibration) in model_variants.items():
        bundle = bundle_stage(ctx, variant, path, upstream, data, calibration)
        report.add_stage(bundle)
        evaluation = eval_stage(ctx, f"bundle-{variant}", bundle, data)
        report.add_eval(f"bundle-{variant}", evaluation)
        release = release_stage(ctx, variant, bundle, evaluation)
        report.add_stage(release)
        releases[variant] = release
        if "model_uri" in release.info:
            alias = f" @{release.info['alias']}" if "alias" in release.info else ""
            report.notes.append(f"{variant}: registered {release.info['model_uri']}{alias} "
                                f"({release.info['gates']})")
        if not release.info.get("gates_passed", True):
            advise(ctx, report, variant, evaluation)
    return releases


def _finish(ctx: PipelineContext, report: PipelineReport, data: StageOutput, rollout: RolloutOutcome | None,
            run_id: str) -> None:
    """Say whether anything was new, log the report to MLflow, publish the Prefect artifacts, remember the run."""
    acted = rollout is not None and rollout.result not in ("already-champion", "decided-before", "manual")
    nothing_new = None if acted else _nothing_new(ctx, data, report)
    if nothing_new:
        report.notes.insert(0, nothing_new)
        console.print(f"[green]✓ {nothing_new}[/]", highlight=False)
    markdown = report.to_markdown()
    mlflow.log_text(markdown, "pipeline_report.md")
    mlflow.log_metric("pipeline_seconds", report.total_seconds)
    publish_artifacts(ctx.recipe.name, report, quantized_table(report), run_id, ctx.workdir.tracking_uri(), rollout)
    _remember_run(ctx, data, run_id)


# --- helpers ---------------------------------------------------------------------------------------------
# (the flow function itself names only picklable globals: Ray's stage runner ships the flow's context, which holds
# the flow, by value; a rich Console holds a lock)

def _skipped_by_a_pause() -> str | None:
    """Say so and return why when this run's schedule is paused (``flows.schedule.current_run_skip_reason``)."""
    reason = current_run_skip_reason()
    if reason:
        console.print(f"[yellow]- {reason}[/]", highlight=False)
    return reason


def _last_run_file(ctx: PipelineContext) -> Path:
    return ctx.workdir.runs / ctx.recipe.name / "last_run.json"


def _remember_run(ctx: PipelineContext, data: StageOutput, mlflow_run_id: str) -> None:
    from prefect.runtime import flow_run

    from artifacts.common.atomic import atomic_write_json

    atomic_write_json(_last_run_file(ctx), {"data_key": data.key, "mlflow_run_id": mlflow_run_id,
                                            "flow_run": flow_run.name or "", "finished_at": time.time()})


def _nothing_new(ctx: PipelineContext, data: StageOutput, report: PipelineReport) -> str | None:
    """When every stage came from cache: say since which run nothing changed, so a quiet night reads so."""
    if not report.stages or not all(s.cached for s in report.stages):
        return None
    path = _last_run_file(ctx)
    try:
        last = json.loads(path.read_text())
    except (OSError, ValueError):
        return "nothing new: every stage came from the cache"
    if last.get("data_key") != data.key:
        return None
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(last.get("finished_at", 0)))
    return (f"no new data since run {last.get('flow_run') or last.get('mlflow_run_id')} ({when}, data "
            f"{data.key[:8]}); nothing to do")


def _configure_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def _use_experiment(name: str) -> None:
    """Artifacts go beside the sqlite store (the workdir's ``mlartifacts/``), not ./mlruns of the directory the
    user stands in."""
    client = mlflow.MlflowClient()
    if client.get_experiment_by_name(name) is None:
        client.create_experiment(name, artifact_location=sqlite_artifact_root(mlflow.get_tracking_uri(), name))
    mlflow.set_experiment(name)
