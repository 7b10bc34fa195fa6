"""The adapter release form (recipe ``release: {form: adapter}``): the stages' adapters stacked into one, bundled
against the base bundle, evaluated on the base as a server's adapter slot runs it, gated and registered with its
base's version (docs/pipeline.md, "The adapter release form"); its rollout stage is ``flows.adapter_rollout``.

The merged form's stages are in ``flows.stage_tasks``; these reuse its context, bundle and eval stages, and its
gate check and registry tags, so both forms record a release the same way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import mlflow

from artifacts.errors import LifecycleError
from flows.report import PipelineReport, adapter_note
from flows.stage_runner import StageOutput, stage_key
from flows.stage_tasks import (
    PipelineContext,
    advise,
    bundle_stage,
    eval_stage,
    lineage,
    record_and_gate,
    tag_release,
)


def release_adapter(ctx: PipelineContext, report: PipelineReport, base: StageOutput,
                    data: StageOutput) -> StageOutput:
    """The adapter form's release, after the training stages: stack, bundle (base and adapter), evaluate, release."""
    trained = [ctx.outputs[name] for name in ("sft", "dpo", "grpo") if getattr(ctx.recipe.training, name).enabled]
    adapter = adapter_stage(ctx, trained)
    report.add_stage(adapter)
    base_bundle = bundle_stage(ctx, "base", base.path, base, data)
    report.add_stage(base_bundle)
    adapter_bundle = adapter_bundle_stage(ctx, adapter, base_bundle, data)
    report.add_stage(adapter_bundle)
    evaluation = eval_stage(ctx, "bundle-adapter", base_bundle, data, adapter=adapter_bundle)
    report.add_eval("bundle-adapter", evaluation)
    # the base bundle holds the base stage's weights, evaluated as "base": its record is that evaluation
    release = adapter_release_stage(ctx, base_bundle, report.evals["base"], adapter_bundle, evaluation)
    report.add_stage(release)
    last = trained[-1].stage
    report.notes.append(adapter_note(adapter, evaluation.metrics, report.evals[last].metrics, last))
    if "model_uri" in release.info:
        alias = f" @{release.info['alias']}" if "alias" in release.info else ""
        report.notes.append(f"adapter: registered {release.info['model_uri']}{alias} on its base "
                            f"{release.info['base_uri']} ({release.info['gates']})")
    if not release.info.get("gates_passed", True):
        advise(ctx, report, "adapter", evaluation)
    return release


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
                             lineage=lineage(ctx, data, adapter.path, Lineage))
        manifest = verify_adapter_bundle(target, base=base_bundle.path)
        return {"adapter_rank": float(manifest.lora.rank)}, {"path": str(target), "version": manifest.version,
                                                              "base_bundle": base_bundle.path}

    return ctx.run("bundle-adapter", key, package, params={"adapter_dir": adapter.path,
                                                           "base_bundle": base_bundle.path})


def adapter_release_stage(ctx: PipelineContext, base_bundle: StageOutput, base_eval: StageOutput,
                          adapter_bundle: StageOutput, evaluation: StageOutput) -> StageOutput:
    """The adapter form's release: the base bundle registered (or found, by its digest) as a version of the
    recipe's model, with its own eval record; the adapter bundle gated on the evals of base + adapter and
    registered as a version of the adapter model, with the base's version in its lineage. The candidate alias goes
    on the adapter version (a base is the ground adapters stand on, not a candidate)."""
    registry = ctx.recipe.registry
    key = stage_key("release-adapter", {"gates": ctx.recipe.gates, "registry": dataclasses.asdict(registry),
                                        "adapter_model": ctx.recipe.adapter_model_name},
                    base_bundle.key, base_eval.key, adapter_bundle.key, evaluation.key)

    def release(out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        # the base's record goes to the base version's own run: one run holds one version's eval_record.json
        base_verdict = record_and_gate(ctx, base_bundle.path, base_eval, log_to_stage_run=False)
        verdict = record_and_gate(ctx, adapter_bundle.path, evaluation)
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
            tag_release(base_ref, base_verdict, False, "")
            ref = register_adapter_bundle(adapter_bundle.path, ctx.recipe.adapter_model_name, base_model=base_model)
            mlflow.MlflowClient().update_model_version(
                ref.name, ref.version, f"{ctx.recipe.name} adapter from the lifecycle pipeline, on "
                                       f"{base_model} version {base_ref.version}\n\n{verdict.description}")
            info.update(tag_release(ref, verdict, True, registry.candidate_alias))
            info.update(base_model=base_model, base_version=base_ref.version,
                        base_uri=f"models:/{base_model}/{base_ref.version}")
        return {"gates_passed": float(verdict.passed)}, info

    return ctx.run("release-adapter", key, release)
