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
        write_bundle(model_path, target, bundle_config, _lineage(ctx, data, model_path, Lineage), quantization)
        manifest = verify_bundle(target)
        return ({"bundle_files": float(len(manifest.files)), "bundle_shards": float(len(manifest.shard_plan.shards))},
                {"path": str(target), "version": manifest.version})

    return ctx.run(f"bundle-{variant}", key, package, params={"model_dir": model_path, **_asdict(config)})


def adapter_stage(ctx: PipelineContext, trained: list[StageOutput]) -> StageOutput:
    """The adapters of the training stages, stacked into one adapter of the base the first stage started from
    (training.adapter_stack: exact, where a fold by SVD would approximate what the evals measured)."""
    key = stage_key("adapter", {"stages": [t.stage for t in trained]}, *[t.key for t in trained])

    def stack(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        from training.adapter_stack import STACK_RECORD, stack_adapters

        missing = [t.stage for t in trained if "adapter_dir" not in t.info]
        if missing:
            raise LifecycleError(f"release.form adapter: stage {missing[0]} left no adapter to ship "
                                 f"({trained[0].path})")
        stacked = stack_adapters([Path(t.info["adapter_dir"]) for t in trained], out_dir / "adapter")
        ranks = json.loads((stacked / STACK_RECORD).read_text(encoding="utf-8"))["ranks"]
        summary = " + ".join(f"{t.stage} r{r}" for t, r in zip(trained, ranks, strict=True))
        return {"adapter_rank": float(sum(ranks))}, {"path": str(stacked), "ranks": ranks,
                                                     "summary": f"stacked {summary} = rank {sum(ranks)}"}

    return ctx.run("adapter", key, stack, params={"stages": ",".join(t.stage for t in trained)})


def adapter_bundle_stage(ctx: PipelineContext, adapter: StageOutput, base_bundle: StageOutput,
                         data: StageOutput) -> StageOutput:
    """The stacked adapter as an adapter bundle bound to the base bundle (artifacts.adapter_bundle)."""
    config = ctx.recipe.bundle
    key = stage_key("bundle-adapter", {"name": ctx.recipe.adapter_model_name, "version": config.version}, adapter.key,
                    base_bundle.key)

    def package(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        import shutil
        from datetime import UTC, datetime

        from artifacts.adapter_bundle import ADAPTER_WEIGHTS, verify_adapter_bundle, write_adapter_bundle
        from artifacts.digests import sha256_file
        from artifacts.manifest import Lineage
        from artifacts.writer import AUTO_VERSION

        target = out_dir / "bundle"
        if target.exists():  # a previous attempt finished writing but not the stage: start clean
            shutil.rmtree(target)
        version = config.version
        if version == AUTO_VERSION:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            version = f"{stamp}-{sha256_file(Path(adapter.path) / ADAPTER_WEIGHTS)[:8]}"
        # named as registered: the name is the adapter's lane at the gateway, what clients ask for as `model`
        write_adapter_bundle(adapter.path, target, base_bundle.path, name=ctx.recipe.adapter_model_name,
                             version=version,
                             lineage=_lineage(ctx, data, adapter.path, Lineage))
        manifest = verify_adapter_bundle(target, base=base_bundle.path)
        return {"adapter_rank": float(manifest.lora.rank)}, {"path": str(target), "version": manifest.version,
                                                              "base_bundle": base_bundle.path}

    return ctx.run("bundle-adapter", key, package, params={"adapter_dir": adapter.path,
                                                           "base_bundle": base_bundle.path})


def release_stage(ctx: PipelineContext, variant: str, bundle: StageOutput, evaluation: StageOutput) -> StageOutput:
    """Write the eval record beside the manifest, check the gates, register the bundle in MLflow."""
    registry = ctx.recipe.registry
    key = stage_key(f"release-{variant}", {"gates": ctx.recipe.gates, "registry": _asdict(registry)},
                    bundle.key, evaluation.key)

    def release(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        verdict = _record_and_gate(ctx, bundle.path, evaluation)
        info: dict[str, Any] = {"path": bundle.path, "gates_passed": verdict.passed, "gates": verdict.summary}
        if registry.enabled:
            from artifacts.registry import register_bundle

            ref = register_bundle(bundle.path, ctx.recipe.registered_model_name,
                                  description=f"{ctx.recipe.name} ({variant}) from the lifecycle pipeline\n\n"
                                              f"{verdict.description}")
            info.update(_tag_release(ref, verdict, variant == ctx.ship_variant, registry.candidate_alias))
        return {"gates_passed": float(verdict.passed)}, info

    return ctx.run(f"release-{variant}", key, release)


def adapter_release_stage(ctx: PipelineContext, base_bundle: StageOutput, base_eval: StageOutput,
                          adapter_bundle: StageOutput, evaluation: StageOutput) -> StageOutput:
    """The adapter form's release: the base bundle registered (or found, by its digest) as a version of the
    recipe's model, with its own eval record; the adapter bundle gated on the evals of base + adapter and
    registered as a version of the adapter model, with the base's version in its lineage. The candidate alias goes
    on the adapter version (a base is the ground adapters stand on, not a candidate)."""
    registry = ctx.recipe.registry
    key = stage_key("release-adapter", {"gates": ctx.recipe.gates, "registry": _asdict(registry),
                                        "adapter_model": ctx.recipe.adapter_model_name},
                    base_bundle.key, base_eval.key, adapter_bundle.key, evaluation.key)

    def release(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        # the base's record goes to the base version's own run: one run holds one version's eval_record.json
        base_verdict = _record_and_gate(ctx, base_bundle.path, base_eval, log_to_stage_run=False)
        verdict = _record_and_gate(ctx, adapter_bundle.path, evaluation)
        info: dict[str, Any] = {"path": adapter_bundle.path, "gates_passed": verdict.passed,
                                "gates": verdict.summary, "base_bundle": base_bundle.path}
        if registry.enabled:
            from artifacts.adapter_registry import register_adapter_bundle
            from artifacts.registry import find_version_by_digest, register_bundle

            base_model = ctx.recipe.registered_model_name
            base_ref = find_version_by_digest(base_bundle.path, base_model)
            if base_ref is None:
                base_ref = register_bundle(base_bundle.path, base_model, tracking_uri=mlflow.get_tracking_uri(),
                                           description=f"{ctx.recipe.name} base, the ground of its adapters "
                                                       f"(release form adapter)\n\n{base_verdict.description}")
                mlflow.MlflowClient().log_artifact(base_ref.run_id, str(base_verdict.record_path))
            _tag_release(base_ref, base_verdict, False, "")
            ref = register_adapter_bundle(adapter_bundle.path, ctx.recipe.adapter_model_name, base_model=base_model)
            mlflow.MlflowClient().update_model_version(
                ref.name, ref.version, f"{ctx.recipe.name} adapter from the lifecycle pipeline, on "
                                       f"{base_model} version {base_ref.version}\n\n{verdict.description}")
            info.update(_tag_release(ref, verdict, True, registry.candidate_alias))
            info.update(base_model=base_model, base_version=base_ref.version,
                        base_uri=f"models:/{base_model}/{base_ref.version}")
        return {"gates_passed": float(verdict.passed)}, info

    return ctx.run("release-adapter", key, release)


@dataclass
class _GateVerdict:
    passed: bool
    summary: str  # the gates report's one line
    count: str  # "3/4 passed": what the version's row shows
    description: str  # for the registry: the summary and one line per gate
    record_path: Path


def _record_and_gate(ctx: PipelineContext, bundle_path: str, evaluation: StageOutput,
                     log_to_stage_run: bool = True) -> _GateVerdict:
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
    return _GateVerdict(report.passed, report.summary(), count,
                        f"Release gates: {report.summary()}\n{gate_lines}\n", record_path)


def _tag_release(ref: Any, verdict: _GateVerdict, candidate: bool, alias: str) -> dict[str, Any]:
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


def adapter_rollout_note(ctx: PipelineContext, release: StageOutput, data: StageOutput):
    """The adapter form's last stage: the commands that roll the new adapter out (never cached).

    The pipeline's own rehearsal fleet is built around one snapshot and its baseline replica; an adapter's rollout
    runs in a lane of the replicas already serving its base, which is the deploy fleet's job, so here the release
    stops at ``candidate`` whatever ``rollout.mode`` says, and the lines say how to go on."""
    from flows.rollout import RolloutOutcome

    if ctx.recipe.rollout.mode == "off" or "version" not in release.info:
        return None
    adapter_uri, version = release.info["model_uri"], str(release.info["version"])
    if "alias" not in release.info:
        line = f"{adapter_uri} failed its gates ({release.info['gates']}); nothing to roll out"
        console.print(f"[yellow]- rollout[/] {line}", highlight=False)
        return RolloutOutcome(version, "gates-failed", [line])
    from serving.rollout import RegistryConsole

    base_model, base_version = ctx.recipe.registered_model_name, str(release.info["base_version"])
    champion = RegistryConsole(base_model, ctx.workdir.tracking_uri()).alias_version("champion")
    lines, base_uri = [], release.info["base_uri"]
    if champion is None:
        lines.append(f"its base {base_uri} must serve first: deploy snapshot {base_uri} --max-loras 4 --wait")
    elif champion != base_version:
        # an adapter is served only in its own base's replicas, and those serve the base model's champion
        lines.append(f"its base {base_uri} is not {base_model}'s champion (v{champion}); an adapter serves only on "
                     f"its own base: roll the base out first (deploy snapshot {base_uri} --max-loras 4 --wait), or "
                     f"register the adapter form's base under a model of its own (registry.model_name) and "
                     "serve it from a fleet of its own (deploy --fleet)")
    lines.append(f"{adapter_uri} is `candidate`; roll it out in its lane with: deploy snapshot {adapter_uri} "
                 f"--probes {data.path} --wait")
    for line in lines:
        console.print(f"[yellow]- rollout[/] adapter form, by hand: {line}", highlight=False)
    return RolloutOutcome(version, "manual", lines)


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
