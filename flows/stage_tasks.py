"""Each stage of the lifecycle flow as the Prefect task it runs as: its cache key and its work.

A stage function (`base_stage`, `training_stage`, ...) derives its cache key from its config and its inputs'
keys and hands its work to `PipelineContext.run`, which runs it as `flows.stage_runner.stage_task` (one cached,
tracked Prefect task); the stage logic itself lives in the stage packages, imported inside the work functions
so that importing this module stays cheap.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow

from artifacts.common.mlflow_batch import log_batch
from artifacts.errors import LifecycleError
from flows.environment import Workdir
from flows.ray_runner import LocalStages
from flows.recipe import Recipe
from flows.report import PipelineReport
from flows.stage_runner import StageOutput, StageWork, console, stage_is_done, stage_key, stage_task


@dataclass
class PipelineContext:
    recipe: Recipe
    workdir: Workdir
    parent_run_id: str | None
    outputs: dict[str, StageOutput] = field(default_factory=dict)
    stages: Any = field(default_factory=LocalStages)  # where stage tasks run (flows.ray_runner)

    def __getstate__(self) -> dict[str, Any]:
        """A stage's work travels to a Ray worker with the context it closes over; the runner stays here."""
        return {**self.__dict__, "stages": None}

    @property
    def ship_variant(self) -> str:
        """The variant that gets the candidate alias: the recipe's choice, else the first quantized one."""
        if self.recipe.registry.ship_variant:
            return self.recipe.registry.ship_variant
        return self.recipe.quantize.methods[0] if self.recipe.quantize else "fp"

    def out_dir(self, stage: str, key: str) -> Path:
        return self.workdir.runs / self.recipe.name / f"{stage}-{key[:12]}"

    def run(self, stage: str, key: str, work_fn, params: dict[str, Any] | None = None,
            resources: dict[str, Any] | None = None) -> StageOutput:
        """Run (or take from cache) one stage task; `resources`: what it asks a Ray cluster for."""
        work = StageWork(stage=stage, key=key, out_dir=self.out_dir(stage, key), run=work_fn,
                         params=params or {})
        # A cached result is only trusted while its directory is complete; otherwise run and re-cache.
        task = stage_task if stage_is_done(work.out_dir) else stage_task.with_options(refresh_cache=True)
        state = self.stages.run(task, {"work": work, "parent_run_id": self.parent_run_id}, resources)
        output: StageOutput = state.result()
        output.cached = state.is_completed() and state.name == "Cached"
        if output.cached:
            console.print(f"[green]✓ {stage}[/] from cache ({output.path})", highlight=False)
        elif "ray_node" in output.info:  # the worker's own lines are in Ray's logs, not on this terminal
            console.print(f"[green]✓ {stage}[/] in {output.seconds:.1f}s on Ray node {output.info['ray_node'][:12]} "
                          f"(pid {output.info['ray_pid']})", highlight=False)
        self.outputs[stage] = output
        return output

    def training_resources(self, config: Any, key: str, device: str = "auto") -> dict[str, Any] | None:
        """A training stage's Ray resources: one GPU (or CPU) per training process; None off Ray."""
        return self.stages.resources(config.distributed.num_processes, device, key)


def base_stage(ctx: PipelineContext) -> StageOutput:
    section = ctx.recipe.base
    if section.is_embedded:
        config = section.embedded
        from training.base_model import shipped_checkpoint

        shipped = shipped_checkpoint(config)  # the package's checkpoint of this recipe, the same on every host
        origin = {"shipped_sha256": shipped.weights_sha256} if shipped is not None else {"pretrained": "here"}
        key = stage_key("base", {**config.recipe(), **origin})

        def build(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
            from training.base_model import ensure_base_model

            built = ensure_base_model(config, ctx.workdir.models / "base")
            metrics: dict[str, float] = {"build_seconds": built.seconds}
            log_file = built.path / "pretrain_log.json"
            if log_file.is_file():
                metrics.update(_log_pretrain_curve(json.loads(log_file.read_text())))
            info = {"path": str(built.path), "reused_build": built.cached, "origin": built.origin}
            if shipped is not None:
                info["summary"] = f"the package's shipped base, sha256 {shipped.weights_sha256[:12]}… checked"
            return metrics, info

        return ctx.run("base", key, build, params={"source": "embedded", **config.recipe(), **origin})

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


def eval_stage(ctx: PipelineContext, label: str, model: StageOutput, data: StageOutput,
               adapter: StageOutput | None = None) -> StageOutput:
    """The recipe's eval suites on ``model`` (with ``adapter`` applied unmerged, as a server's slot applies it)."""
    config = ctx.recipe.evals
    key = stage_key(f"eval-{label}", config, model.key, data.key, *([adapter.key] if adapter else []))

    def evaluate(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from evals.results import markdown_table, metrics_dict, write_results_json
        from evals.runner import run_evals
        from evals.tracking import log_results

        results = run_evals(model.path, data.path, config, adapter=adapter.path if adapter else None)
        write_results_json(results, out_dir / "eval_results.json")
        log_results(results)
        mlflow.set_tag("lifecycle.evaluated_model", model.path)
        info = {"model": model.path, "table": markdown_table(results)}
        if adapter is not None:
            mlflow.set_tag("lifecycle.evaluated_adapter", adapter.path)
            info["adapter"] = adapter.path
        return metrics_dict(results), info

    params = {"model_dir": model.path, **({"adapter_dir": adapter.path} if adapter else {}), **_asdict(config)}
    return ctx.run(f"eval-{label}", key, evaluate, params=params)


def training_stage(ctx: PipelineContext, name: str, previous: StageOutput, data: StageOutput) -> StageOutput:
    config = getattr(ctx.recipe.training, name)
    key = stage_key(name, config.recipe(), previous.key, data.key)  # `distributed` moves the work, not its result

    def train(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from training import dpo, grpo, sft

        runner = {"sft": sft.run_sft, "dpo": dpo.run_dpo, "grpo": grpo.run_grpo}[name]
        result = runner(config, Path(previous.path), Path(data.path), out_dir / "stage")
        info = {"path": str(result.output_dir)}
        if result.adapter_dir is not None:
            info["adapter_dir"] = str(result.adapter_dir)
        return dict(result.metrics), info

    return ctx.run(name, key, train, params={"input_model": previous.path, **_asdict(config)},
                   resources=ctx.training_resources(config, f"training.{name}.distributed.num_processes"))


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
        # overwrite: a previous attempt may have published the draft but died before its STAGE_DONE record
        result = build_draft(model.path, out_dir / "draft", config, texts, overwrite=True)
        mlflow.log_artifact(str(result.path / DRAFT_RECORD))
        return result.metrics(), {"path": str(result.path), "target": model.path,
                                  "layers": f"{result.layers} of {result.target_layers}", "text_source": source}

    return ctx.run("draft", key, build, params={"input_model": model.path, **_asdict(config)},
                   resources=ctx.training_resources(config, "draft.distributed.num_processes", config.device))


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
        write_bundle(model_path, target, bundle_config, lineage(ctx, data, model_path, Lineage), quantization)
        manifest = verify_bundle(target)
        return ({"bundle_files": float(len(manifest.files)), "bundle_shards": float(len(manifest.shard_plan.shards))},
                {"path": str(target), "version": manifest.version})

    return ctx.run(f"bundle-{variant}", key, package, params={"model_dir": model_path, **_asdict(config)})


def release_stage(ctx: PipelineContext, variant: str, bundle: StageOutput, evaluation: StageOutput) -> StageOutput:
    """Write the eval record beside the manifest, check the gates, register the bundle in MLflow."""
    registry = ctx.recipe.registry
    key = stage_key(f"release-{variant}", {"gates": ctx.recipe.gates, "registry": _asdict(registry)},
                    bundle.key, evaluation.key)

    def release(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        verdict = record_and_gate(ctx, bundle.path, evaluation)
        info: dict[str, Any] = {"path": bundle.path, "gates_passed": verdict.passed, "gates": verdict.summary}
        if registry.enabled:
            from artifacts.registry import register_bundle

            ref = register_bundle(bundle.path, ctx.recipe.registered_model_name,
                                  description=f"{ctx.recipe.name} ({variant}) from the lifecycle pipeline\n\n"
                                              f"{verdict.description}")
            info.update(tag_release(ref, verdict, variant == ctx.ship_variant, registry.candidate_alias))
        return {"gates_passed": float(verdict.passed)}, info

    return ctx.run(f"release-{variant}", key, release)


@dataclass
class GateVerdict:
    passed: bool
    summary: str  # the gates report's one line
    count: str  # "3/4 passed": what the version's row shows
    description: str  # for the registry: the summary and one line per gate
    record_path: Path


def record_and_gate(ctx: PipelineContext, bundle_path: str, evaluation: StageOutput,
                    log_to_stage_run: bool = True) -> GateVerdict:
    """Check the recipe's gates on ``evaluation`` and write the eval record beside the bundle's manifest (also
    logged to the stage's run, beside the version registered from it, so a rollout controller on another host
    reads the version's record)."""
    from artifacts.eval_record import write_eval_record
    from evals.gates import check_gates
    from evals.results import read_results_json, to_jsonable

    results = read_results_json(Path(evaluation.path) / "eval_results.json")
    report = check_gates(results, ctx.recipe.parsed_gates())
    gate_record = {str(c.gate): {"measured": c.measured, "passed": c.passed, "reason": c.reason}
                   for c in report.checks}
    # the results carry each metric's sample count: a rollout compares the record with the champion's
    record_path = write_eval_record(bundle_path, metrics=evaluation.metrics, gates=gate_record,
                                    passed=report.passed, results=to_jsonable(results))
    if log_to_stage_run:
        mlflow.set_tag("lifecycle.gates", report.summary())
        mlflow.log_artifact(str(record_path))
    gate_lines = "\n".join(f"- {'✓' if c.passed else '✗'} {c.reason}" for c in report.checks)
    count = f"{sum(c.passed for c in report.checks)}/{len(report.checks)} passed"
    return GateVerdict(report.passed, report.summary(), count,
                       f"Release gates: {report.summary()}\n{gate_lines}\n", record_path)


def tag_release(ref: Any, verdict: GateVerdict, candidate: bool, alias: str) -> dict[str, Any]:
    """The verdict, short, on the version's row (the registry is where people decide promotions); the
    ``alias`` on it when it is the ``candidate`` and passed."""
    from artifacts.registry import set_alias

    client = mlflow.MlflowClient()
    client.set_model_version_tag(ref.name, ref.version, "lifecycle.gates_passed", str(verdict.passed).lower())
    client.set_model_version_tag(ref.name, ref.version, "lifecycle.gates", verdict.count)
    info: dict[str, Any] = {"model_uri": f"models:/{ref.name}/{ref.version}", "version": ref.version}
    if candidate and verdict.passed:
        set_alias(ref.name, alias, ref.version)
        info["alias"] = alias
    return info


def advise(ctx: PipelineContext, report: PipelineReport, variant: str, evaluation: StageOutput) -> None:
    """A release that failed its gates: which stage lost each metric, and the recipe keys to look at."""
    from evals.gates import failed_gates
    from flows.gate_advice import failed_gate_advice

    chain = [label for label in ("base", "sft", "dpo", "grpo") if label in report.evals]
    chain += (["bundle-fp"] if variant not in ("fp", "adapter") else []) + [f"bundle-{variant}"]
    failed = failed_gates(ctx.recipe.parsed_gates(), evaluation.metrics)
    for line in failed_gate_advice(failed, {label: out.metrics for label, out in report.evals.items()}, chain):
        console.print(f"[yellow]- release-{variant}[/] {line}", highlight=False)
        report.notes.append(f"{variant}: {line}")


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


def lineage(ctx: PipelineContext, data: StageOutput, model_path: str, lineage_cls: Any) -> Any:
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
    return dataclasses.replace(obj, **changes)


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
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
