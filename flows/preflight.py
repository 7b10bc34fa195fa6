"""Checks that can fail in milliseconds, run before Prefect starts and before any stage trains.

A recipe that names a directory that is not a model, or a local dataset without the columns its stage
needs, must fail before the pipeline spends minutes on a base model or an earlier stage. So must every
recipe value that depends on the model: once a stage has trained, a LoRA target the model lacks, a
sequence longer than its context or a tensor-parallel degree its heads cannot take costs all the work
before it. The model's shape comes from a local directory's config.json, or for the embedded base from
its preset; no weights are loaded and nothing is built. Each refusal is one line,
`<recipe file>: <recipe key>: <reason>`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NoReturn

from artifacts.errors import ConfigError
from flows.recipe import Recipe

_STAGES = ("sft", "dpo", "grpo")


def preflight(recipe: Recipe, source: str | Path | None = None) -> None:
    """Raise the stage's own LifecycleError (or a ConfigError naming the recipe key) for the first input that
    cannot work. `source` is the recipe file, named in the error line."""
    where = str(source) if source is not None else f"recipe {recipe.name!r}"
    if recipe.runner.kind == "ray":
        from flows.ray_runner import check_address, resolve_address

        check_address(resolve_address(recipe.runner.address), where)
    if not recipe.base.is_embedded:
        from training.base_model import validate_model_dir

        validate_model_dir(Path(recipe.base.source))
    check_model_fit(recipe, base_model_config(recipe), where)
    data = recipe.data
    local = {"sft": data.sft_path, "preference": data.preference_path, "grpo": data.grpo_path}
    if any(local.values()):
        from datasets.utils.logging import disable_progress_bar, enable_progress_bar

        from training.loaders import load_local_dataset

        disable_progress_bar()  # a check, not work: its answer is the error line or nothing
        try:
            for kind, path in local.items():
                if path:
                    load_local_dataset(path, kind)
        finally:
            enable_progress_bar()


def base_model_config(recipe: Recipe) -> dict[str, Any]:
    """The base model's config.json fields: read from a local directory, derived from the embedded preset."""
    if recipe.base.is_embedded:
        embedded = recipe.base.embedded.llama_config_kwargs()
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "dtype": "float32", **embedded}
    return json.loads((Path(recipe.base.source) / "config.json").read_text(encoding="utf-8"))


def check_model_fit(recipe: Recipe, config: dict[str, Any], where: str) -> None:
    """Refuse the first recipe value the model described by `config` (config.json fields) cannot take.

    What is checked, in pipeline order: the model is a Llama-family type the bundle stage can package; each
    enabled training stage's `lora.target_modules` names linear layers the model has and its `max_seq_len`
    fits the context (`max_position_embeddings`), GRPO's `max_completion_length` leaves room for a prompt;
    `evals.max_new_tokens` leaves room for a prompt; `draft.layers` keeps fewer layers than the model has and
    `draft.seq_len` fits the context; `quantize.calibration_seq_len` fits the context and
    `quantize.group_size` / `quantize.methods` fit the layer widths; `bundle.max_context` fits the context;
    every `bundle.tp_degrees` entry fits the heads (see `artifacts.shard_plan`) and every split tensor of
    the full-precision bundle and of each quantized one.
    """
    from artifacts.model_spec import SUPPORTED_BITS, SpecError, model_spec

    def fail(key: str, reason: str) -> NoReturn:
        raise ConfigError(f"{where}: {key}: {reason}")

    try:
        spec = model_spec(config)
    except SpecError as exc:
        fail("base.source", f"{exc}; the bundle stage packages Llama-family checkpoints only")
    arch = spec.arch
    context = arch.max_position_embeddings
    in_context = f"the model's context (max_position_embeddings {context})"
    linear_names = sorted({prefix.rsplit(".", 1)[-1] for prefix in spec.linears if prefix != "lm_head"})

    for name in _STAGES:
        stage = getattr(recipe.training, name)
        if not stage.enabled:
            continue
        missing = [m for m in stage.lora.target_modules if m not in linear_names]
        if missing:
            fail(f"training.{name}.lora.target_modules",
                 f"{missing} not found in the model; its linear layers are {linear_names}")
        if stage.max_seq_len > context:
            fail(f"training.{name}.max_seq_len", f"{stage.max_seq_len} exceeds {in_context}")
    grpo = recipe.training.grpo
    if grpo.enabled and grpo.max_completion_length >= context:
        fail("training.grpo.max_completion_length",
             f"{grpo.max_completion_length} leaves no room for a prompt in {in_context}: prompt + completion "
             "must fit")
    if recipe.evals.max_new_tokens >= context:
        fail("evals.max_new_tokens", f"{recipe.evals.max_new_tokens} leaves no room for a prompt in {in_context}")

    draft = recipe.draft
    if draft is not None:
        if draft.layers >= arch.num_layers:
            fail("draft.layers", f"{draft.layers} keeps all of the model's {arch.num_layers} decoder layers; a draft "
                                 "keeps fewer")
        if draft.seq_len > context:
            fail("draft.seq_len", f"{draft.seq_len} exceeds {in_context}")

    quantize = recipe.quantize
    if quantize is not None:
        if quantize.bits not in SUPPORTED_BITS:
            fail("quantize.bits", f"{quantize.bits}-bit checkpoints cannot be bundled (bundles take {SUPPORTED_BITS})")
        if quantize.calibration_seq_len > context:
            fail("quantize.calibration_seq_len", f"{quantize.calibration_seq_len} exceeds {in_context}")
        _check_quantize_compat(quantize, config, fail)

    bundle = recipe.bundle
    if bundle.max_context is not None and bundle.max_context > context:
        fail("bundle.max_context", f"{bundle.max_context} exceeds {in_context}")
    from artifacts.shard_plan import TPDegreeError, plan_shards

    layouts = _bundle_layouts(spec, quantize)
    for degree in bundle.tp_degrees:
        for label, shapes in layouts.items():
            try:
                plan_shards(shapes, degree, arch.num_heads, arch.num_kv_heads)
            except TPDegreeError as exc:
                fail("bundle.tp_degrees", f"{exc}{label}")


def _check_quantize_compat(quantize: Any, config: dict[str, Any], fail) -> None:
    """quantize's own model check, once per key: the group size against every in-feature, AWQ's widths."""
    from quantize.config import check_model_compat
    from quantize.errors import QuantizeError

    marker = "model"
    for key, variant in (("quantize.group_size", dataclasses.replace(quantize, methods=["gptq"])),
                         ("quantize.methods", dataclasses.replace(quantize, group_size=-1))):
        try:
            check_model_compat(variant, config, source=marker)
        except QuantizeError as exc:
            fail(key, str(exc).removeprefix(f"{marker}: "))


def _bundle_layouts(spec: Any, quantize: Any) -> dict[str, dict[str, list[int]]]:
    """Tensor shapes of every bundle the pipeline will write (full precision, then one per quantize method),
    keyed by the suffix an error names it with. The quantize stage keeps lm_head in full precision."""
    from artifacts.model_spec import QuantizationInfo, quantized_shapes
    from quantize.config import QuantizeConfig

    dense = {**spec.dense, **spec.optional}
    fp = dict(dense)
    for prefix, lin in spec.linears.items():
        fp[f"{prefix}.weight"] = [lin.out_features, lin.in_features]
    layouts = {"": fp}
    methods = quantize.methods if isinstance(quantize, QuantizeConfig) else []
    for method in methods:
        info = QuantizationInfo(method=method, bits=quantize.bits, group_size=quantize.group_size)
        shapes = dict(dense)
        for prefix, lin in spec.linears.items():
            if prefix == "lm_head":
                shapes[f"{prefix}.weight"] = [lin.out_features, lin.in_features]
                continue
            for suffix, (_, shape) in quantized_shapes(lin, info).items():
                shapes[f"{prefix}.{suffix}"] = shape
        layouts[f" (in the {method} bundle: {quantize.bits}-bit, group_size {quantize.group_size})"] = shapes
    return layouts
