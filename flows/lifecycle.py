"""The lifecycle flow: base → data → SFT → DPO → GRPO → (draft) → quantize → bundle → verify → register → evals →
rollout.

Each stage reads the previous stage's output directory and writes its own, so any stage can be re-run,
cached or moved to another machine; this module only decides the order, the cache keys and the MLflow run
structure. Stage logic lives in the stage packages. Importing this module is cheap; heavy imports happen
inside the stages.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
from prefect import flow

from artifacts.common.mlflow_batch import log_batch
from artifacts.common.workdir import sqlite_artifact_root
from artifacts.errors import LifecycleError
from flows.environment import Workdir, resolve_workdir
from flows.notify import notify_failure
from flows.prefect_artifacts import publish_artifacts
from flows.recipe import Recipe, load_recipe
from flows.report import PipelineReport, stage_change_note
from flows.stage_runner import StageOutput, StageWork, console, is_complete, run_stage, stage_key


@dataclass
class PipelineContext:
    recipe: Recipe
    workdir: Workdir
    parent_run_id: str | None
    outputs: dict[str, StageOutput] = field(default_factory=dict)

    @property
    def ship_variant(self) -> str:
        """The variant that gets the candidate alias: the recipe's choice, else the first quantized one."""
        if self.recipe.registry.ship_variant:
            return self.recipe.registry.ship_variant
        return self.recipe.quantize.methods[0] if self.recipe.quantize else "fp"

    def out_dir(self, stage: str, key: str) -> Path:
        return self.workdir.runs / self.recipe.name / f"{stage}-{key[:12]}"

    def run(self, stage: str, key: str, work_fn, params: dict[str, Any] | None = None) -> StageOutput:
        work = StageWork(stage=stage, key=key, out_dir=self.out_dir(stage, key), run=work_fn,
                         params=params or {})
        # A cached result is only trusted while its directory is complete; otherwise run and re-cache.
        task = run_stage if is_complete(work.out_dir) else run_stage.with_options(refresh_cache=True)
        state = task(work, self.parent_run_id, return_state=True)
        output: StageOutput = state.result()
        output.cached = state.is_completed() and state.name == "Cached"
        if output.cached:
            console.print(f"[green]✓ {stage}[/] from cache ({output.path})", highlight=False)
        self.outputs[stage] = output
        return output


# --- stages ----------------------------------------------------------------------------------------------

def base_stage(ctx: PipelineContext) -> StageOutput:
    section = ctx.recipe.base
    if section.is_embedded:
        config = section.embedded
        key = stage_key("base", config.recipe())

        def build(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
            from training.base_model import ensure_base_model

            built = ensure_base_model(config, ctx.workdir.models / "base")
            metrics: dict[str, float] = {"build_seconds": built.seconds}
            log_file = built.path / "pretrain_log.json"
            if log_file.is_file():
                metrics.update(_log_pretrain_curve(json.loads(log_file.read_text())))
            return metrics, {"path": str(built.path), "reused_build": built.cached}

        return ctx.run("base", key, build, params={"source": "embedded", **config.recipe()})

    source = Path(section.source)
    key = stage_key("base", {"source": str(source)}, extra=_dir_fingerprint(source))

    def resolve(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from training.base_model import validate_model_dir

        return {}, {"path": str(validate_model_dir(source))}

    return ctx.run("base", key, resolve, params={"source": str(source)})


def data_stage(ctx: PipelineContext) -> StageOutput:
    config = ctx.recipe.data
    key = data_key(config)

    def build(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from training.data import build_datasets

        manifest = build_datasets(config, out_dir / "data")
        mlflow.log_dict(manifest.to_json(), "data_manifest.json")
        metrics = {f"records/{name}": float(count) for name, count in manifest.counts.items()}
        return metrics, {"path": str(manifest.path), "digest": manifest.digest, "files": manifest.files,
                         "sources": local_sources(config)}

    return ctx.run("data", key, build, params=_asdict(config))


def local_sources(config: Any) -> dict[str, dict[str, str]]:
    """sha256 of every local file the data stage reads (a dataset directory: each file in it)."""
    from artifacts.digests import sha256_file
    from training.loaders import dataset_files

    out: dict[str, dict[str, str]] = {}
    for path in (config.sft_path, config.preference_path, config.grpo_path):
        if path:
            try:
                files = dataset_files(path)
            except LifecycleError:
                files = []  # an empty directory: the data stage itself says so, naming it
            out[str(path)] = {f.name: sha256_file(f) if f.is_file() else "missing" for f in files}
    return out


def data_key(config: Any) -> str:
    """The data stage's key: its config and the content of every file it reads, so a new or changed file
    re-runs the data stage and everything after it, and nothing before it."""
    return stage_key("data", config, extra=local_sources(config))


def eval_stage(ctx: PipelineContext, label: str, model: StageOutput, data: StageOutput) -> StageOutput:
    config = ctx.recipe.evals
    key = stage_key(f"eval-{label}", config, model.key, data.key)

    def evaluate(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from evals.results import markdown_table, metrics_dict, write_results_json
        from evals.runner import run_evals
        from evals.tracking import log_results

        results = run_evals(model.path, data.path, config)
        write_results_json(results, out_dir / "eval_results.json")
        log_results(results)
        mlflow.set_tag("lifecycle.evaluated_model", model.path)
        return metrics_dict(results), {"model": model.path, "table": markdown_table(results)}

    return ctx.run(f"eval-{label}", key, evaluate, params={"model_dir": model.path, **_asdict(config)})


def training_stage(ctx: PipelineContext, name: str, previous: StageOutput, data: StageOutput) -> StageOutput:
    config = getattr(ctx.recipe.training, name)
    key = stage_key(name, config, previous.key, data.key)

    def train(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from training import dpo, grpo, sft

        runner = {"sft": sft.run_sft, "dpo": dpo.run_dpo, "grpo": grpo.run_grpo}[name]
        result = runner(config, Path(previous.path), Path(data.path), out_dir / "stage")
        info = {"path": str(result.output_dir)}
        if result.adapter_dir is not None:
            info["adapter_dir"] = str(result.adapter_dir)
        return dict(result.metrics), info

    return ctx.run(name, key, train, params={"input_model": previous.path, **_asdict(config)})


def draft_stage(ctx: PipelineContext, model: StageOutput, data: StageOutput) -> StageOutput:
    """A distilled draft of the final full-precision model, for `serve --speculative-model` (recipe `draft:`).

    It learns from the text the model learned from: the embedded corpus for the embedded base, else the data
    stage's SFT chats. Nothing later reads it; the report says how to serve with it."""
    config = ctx.recipe.draft
    section = ctx.recipe.base
    key = stage_key("draft", config.recipe(), model.key, data.key)

    def build(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from training.draft import DRAFT_RECORD, build_draft, data_stage_texts

        if section.is_embedded:
            from training.corpus import build_corpus

            texts, source = build_corpus(section.embedded.corpus_spec()), "the embedded corpus"
        else:
            texts, source = data_stage_texts(Path(data.path)), "the data stage's SFT chats"
        # overwrite: a previous attempt may have published the draft but died before the stage's marker
        result = build_draft(model.path, out_dir / "draft", config, texts, overwrite=True)
        mlflow.log_artifact(str(result.path / DRAFT_RECORD))
        return result.metrics(), {"path": str(result.path), "target": model.path,
                                  "layers": f"{result.layers} of {result.target_layers}", "text_source": source}

    return ctx.run("draft", key, build, params={"input_model": model.path, **_asdict(config)})


def quantize_stage(ctx: PipelineContext, model: StageOutput, data: StageOutput) -> StageOutput:
    config = ctx.recipe.quantize
    key = stage_key("quantize", config, model.key, data.key)

    def quantize(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from quantize.pipeline import run_quantization

        result = run_quantization(config, Path(model.path), Path(data.path), out_dir / "models")
        # RTN is the comparison baseline, not a shipping format: only the recipe's methods get bundled.
        outputs = {method: str(result.outputs[method]) for method in config.methods}
        # The fidelity report has logged its own metrics (fidelity.<method>.kl_mean, ...) into this run.
        return {}, {
            "outputs": outputs,
            "calibration_digest": result.calibration_digest,
            "fidelity_table": result.report.to_markdown(),
        }

    return ctx.run("quantize", key, quantize, params={"input_model": model.path, **_asdict(config)})


def bundle_stage(ctx: PipelineContext, variant: str, model_path: str, upstream: StageOutput,
                 data: StageOutput, calibration_digest: str | None = None) -> StageOutput:
    """Freeze one model dir (full precision or one quantized variant) into a verified bundle."""
    config = ctx.recipe.bundle
    key = stage_key(f"bundle-{variant}", config, upstream.key, data.key)

    def package(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from artifacts.manifest import Lineage
        from artifacts.verify import verify_bundle
        from artifacts.writer import write_bundle

        target = out_dir / "bundle"
        if target.exists():  # a previous attempt finished writing but not the stage: start clean
            import shutil

            shutil.rmtree(target)
        bundle_config = _replace(config, name=f"{config.name}-{variant}" if variant != "fp" else config.name)
        quantization = None
        if calibration_digest:
            from artifacts.model_spec import quantization_from_config

            quantization = quantization_from_config(json.loads((Path(model_path) / "config.json").read_text()))
            if quantization is not None:
                quantization = _replace(quantization, calibration_digest=calibration_digest)
        write_bundle(model_path, target, bundle_config, _lineage(ctx, data, model_path, Lineage), quantization)
        manifest = verify_bundle(target)
        return ({"bundle_files": float(len(manifest.files)), "bundle_shards": float(len(manifest.shard_plan.shards))},
                {"path": str(target), "version": manifest.version})

    return ctx.run(f"bundle-{variant}", key, package, params={"model_dir": model_path, **_asdict(config)})


def release_stage(ctx: PipelineContext, variant: str, bundle: StageOutput, evaluation: StageOutput) -> StageOutput:
    """Write the eval record beside the manifest, check the gates, register the bundle in MLflow."""
    gates = ctx.recipe.parsed_gates()
    registry = ctx.recipe.registry
    key = stage_key(f"release-{variant}", {"gates": ctx.recipe.gates, "registry": _asdict(registry)},
                    bundle.key, evaluation.key)

    def release(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from artifacts.eval_record import write_eval_record
        from evals.gates import check_gates
        from evals.results import read_results_json, to_jsonable

        results = read_results_json(Path(evaluation.path) / "eval_results.json")
        report = check_gates(results, gates)
        gate_record = {str(c.gate): {"measured": c.measured, "passed": c.passed, "reason": c.reason}
                       for c in report.checks}
        # the results carry each metric's sample count: a rollout compares the record with the champion's
        record_path = write_eval_record(bundle.path, metrics=evaluation.metrics, gates=gate_record,
                                        passed=report.passed, results=to_jsonable(results))
        mlflow.set_tag("lifecycle.gates", report.summary())
        # beside the version's run, so a rollout controller on another host reads the candidate's record
        mlflow.log_artifact(str(record_path))
        info: dict[str, Any] = {"path": bundle.path, "gates_passed": report.passed, "gates": report.summary()}
        if registry.enabled:
            from artifacts.registry import register_bundle, set_alias

            gate_lines = "\n".join(f"- {'✓' if c.passed else '✗'} {c.reason}" for c in report.checks)
            ref = register_bundle(bundle.path, ctx.recipe.registered_model_name,
                                  description=f"{ctx.recipe.name} ({variant}) from the lifecycle pipeline\n\n"
                                              f"Release gates: {report.summary()}\n{gate_lines}\n")
            info.update(model_uri=f"models:/{ref.name}/{ref.version}", version=ref.version)
            # The registry is where people decide promotions: the verdict, short, on the version's row.
            client = mlflow.MlflowClient()
            client.set_model_version_tag(ref.name, ref.version, "lifecycle.gates_passed", str(report.passed).lower())
            passed = sum(c.passed for c in report.checks)
            client.set_model_version_tag(ref.name, ref.version, "lifecycle.gates",
                                         f"{passed}/{len(report.checks)} passed")
            if report.passed and variant == ctx.ship_variant:
                set_alias(ref.name, registry.candidate_alias, ref.version)
                info["alias"] = registry.candidate_alias
        return {"gates_passed": float(report.passed)}, info

    return ctx.run(f"release-{variant}", key, release)


def rollout_stage(ctx: PipelineContext, release: StageOutput | None, data: StageOutput,
                  full_precision: StageOutput | None = None):
    """Put the new candidate in front of traffic (recipe `rollout.mode`); never cached: it acts on the world.

    ``full_precision``: the fp release of the same model; where no champion exists yet it becomes the first
    champion and a quantized candidate is rolled out against it."""
    section = ctx.recipe.rollout
    if section.mode == "off" or not ctx.recipe.registry.enabled:
        return None
    if release is None or "version" not in release.info:
        return None
    if "alias" not in release.info:
        from flows.rollout import RolloutOutcome

        line = f"v{release.info['version']} failed its gates ({release.info['gates']}); nothing to roll out"
        console.print(f"[yellow]- rollout[/] {line}", highlight=False)
        return RolloutOutcome(release.info["version"], "gates-failed", [line])
    from flows.rollout import pipeline_rollout

    first = None
    if full_precision is not None and full_precision is not release and "version" in full_precision.info \
            and full_precision.info.get("gates_passed"):
        first = (str(full_precision.info["version"]), full_precision.path)
    return pipeline_rollout(section, ctx.recipe.registered_model_name, str(release.info["version"]), release.path,
                            data.path, ctx.workdir.tracking_uri(),
                            str(ctx.workdir.runs / ctx.recipe.name / "fleet"),
                            eval_passed=bool(release.info.get("gates_passed")), first_champion=first)


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
    from flows import quiet_logs

    quiet_logs.install()  # also when a worker, not `lifecycle run`, started this run
    started = time.perf_counter()
    recipe = load_recipe(recipe_path)
    workdir = resolve_workdir(recipe.workdir)
    _configure_threads(recipe.threads)
    mlflow.set_tracking_uri(workdir.tracking_uri())
    _use_experiment(recipe.name)
    report = PipelineReport(recipe_name=recipe.name)

    with mlflow.start_run(run_name=f"{recipe.name}-pipeline") as parent:
        mlflow.set_tags({"lifecycle.recipe": str(Path(recipe_path).resolve()), "lifecycle.kind": "pipeline"})
        mlflow.log_artifact(str(recipe_path), artifact_path="recipe")
        ctx = PipelineContext(recipe=recipe, workdir=workdir, parent_run_id=parent.info.run_id)

        base = base_stage(ctx)
        data = data_stage(ctx)
        report.add_stage(base)
        report.add_stage(data)
        report.add_eval("base", eval_stage(ctx, "base", base, data))

        model, model_label = base, "base"
        for name in ("sft", "dpo", "grpo"):
            if not getattr(recipe.training, name).enabled:
                console.print(f"[yellow]- {name}[/] disabled in the recipe", highlight=False)
                continue
            model = training_stage(ctx, name, model, data)
            report.add_stage(model)
            report.add_eval(name, eval_stage(ctx, name, model, data))
            report.notes.append(stage_change_note(name, model_label, report.evals[name].metrics,
                                                  report.evals[model_label].metrics))
            model_label = name

        draft = None
        if recipe.draft is not None:
            draft = draft_stage(ctx, model, data)
            report.add_stage(draft)

        model_variants: dict[str, tuple[str, StageOutput, str | None]] = {"fp": (model.path, model, None)}
        quantized = None
        if recipe.quantize is not None:
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

        if draft is not None:
            report.notes.append(draft_note(draft, releases.get(ctx.ship_variant)))

        rollout = rollout_stage(ctx, releases.get(ctx.ship_variant), data, releases.get("fp"))
        if rollout is not None:
            report.notes.append("rollout:\n\n" + "\n".join(f"    {line}" for line in rollout.lines))

        report.total_seconds = time.perf_counter() - started
        acted = rollout is not None and rollout.result not in ("already-champion", "decided-before", "manual")
        nothing_new = None if acted else _nothing_new(ctx, data, report)
        if nothing_new:
            report.notes.insert(0, nothing_new)
            console.print(f"[green]✓ {nothing_new}[/]", highlight=False)
        markdown = report.to_markdown()
        mlflow.log_text(markdown, "pipeline_report.md")
        mlflow.log_metric("pipeline_seconds", report.total_seconds)
        publish_artifacts(recipe.name, report, quantized_table(report), parent.info.run_id,
                          workdir.tracking_uri(), rollout)
        _remember_run(ctx, data, parent.info.run_id)
        return report.to_dict() | {"mlflow_run_id": parent.info.run_id,
                                   "tracking_uri": workdir.tracking_uri(),
                                   "rollout": None if rollout is None else {
                                       "version": rollout.version, "result": rollout.result,
                                       "lines": rollout.lines, "mlflow_run_id": rollout.mlflow_run_id}}


# --- helpers ---------------------------------------------------------------------------------------------

def quantized_table(report: PipelineReport) -> str:
    stage = next((s for s in report.stages if s.stage == "quantize"), None)
    return stage.info.get("fidelity_table", "") if stage is not None else ""


def draft_note(draft: StageOutput, shipped: StageOutput | None) -> str:
    """The report's line on the draft: what it agrees on, and the exact command that serves with it."""
    served = shipped.path if shipped is not None else draft.info["target"]
    before, after = draft.metrics.get("agreement_before", 0.0), draft.metrics.get("agreement_after", 0.0)
    return (f"draft model ({draft.info.get('layers', '?')} layers, argmax agreement with its target "
            f"{before:.2f} → {after:.2f} on held-out text): `{draft.path}`; serve with it: "
            f"`lifecycle serve {served} --speculative-tokens 4 --speculative-model {draft.path}`")


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


def _lineage(ctx: PipelineContext, data: StageOutput, model_path: str, lineage_cls: Any) -> Any:
    base = ctx.outputs["base"]
    stage_runs = {name: out.mlflow_run_id for name, out in ctx.outputs.items()
                  if out.mlflow_run_id and not name.startswith(("eval-", "release-", "bundle-", "draft"))}
    return lineage_cls(
        base_model=ctx.recipe.base.source,
        base_model_digest=base.key,
        stage_runs=stage_runs,
        dataset_digests={"data": data.info.get("digest", data.key), **data.info.get("files", {})},
        git_commit=None,
        source_dir=model_path,
    )


def _replace(obj: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **changes)


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


def _log_pretrain_curve(log: Any) -> dict[str, float]:
    """Log the base model's loss curve as step metrics; return its summary."""
    rows = log.get("history", log) if isinstance(log, dict) else log
    if not isinstance(rows, list) or not rows:
        return {}
    curve = [("pretrain_loss", float(r["loss"]), int(r.get("step", i)))
             for i, r in enumerate(rows) if isinstance(r, dict) and "loss" in r]
    run = mlflow.active_run()
    if curve and run is not None:
        log_batch(run.info.run_id, metrics=curve)  # the whole curve, however long
    return {"pretrain_final_loss": curve[-1][1]} if curve else {}


def _dir_fingerprint(path: Path) -> dict[str, Any]:
    """Sizes and mtimes of a local model dir's files: cheap, and changes whenever the weights do."""
    if not path.is_dir():
        return {}
    return {p.name: _file_fingerprint(p) for p in sorted(path.iterdir()) if p.is_file()}


def _file_fingerprint(path: Path) -> list[float]:
    try:
        stat = path.stat()
    except OSError:
        return []
    return [stat.st_size, stat.st_mtime]


def _asdict(config: Any) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    return asdict(config) if is_dataclass(config) else dict(config)
