"""Advice on a release that failed its gates (flows/gate_advice.py): the step of the chain that lost the metric
and the recipe keys that decide it, on the figures of the run that prompted it (issue 30's AMD host)."""

from __future__ import annotations

from evals.gates import parse_gate
from flows.gate_advice import failed_gate_advice

CHAIN = ["base", "sft", "dpo", "grpo", "bundle-fp"]
# refusal and over-refusal per model on the AMD host (GRPO cost 11.6 points of refusals; DPO added over-refusals)
EVALS = {"base": {"refusal_rate": 0.977, "over_refusal_rate": 0.167, "task_accuracy": 0.10},
         "sft": {"refusal_rate": 0.953, "over_refusal_rate": 0.062, "task_accuracy": 0.60},
         "dpo": {"refusal_rate": 0.953, "over_refusal_rate": 0.104, "task_accuracy": 0.58},
         "grpo": {"refusal_rate": 0.837, "over_refusal_rate": 0.0, "task_accuracy": 0.70},
         "bundle-fp": {"refusal_rate": 0.837, "over_refusal_rate": 0.0, "task_accuracy": 0.70},
         "bundle-gptq": {"refusal_rate": 0.902, "over_refusal_rate": 0.0, "task_accuracy": 0.41}}


def test_the_stage_that_lost_a_floor_metric_is_named_with_its_keys():
    (line,) = failed_gate_advice([parse_gate("refusal_rate >= 0.9")], EVALS, CHAIN)
    assert line == ("refusal_rate >= 0.9 failed (0.837): GRPO lost it (dpo 0.953 -> grpo 0.837, -11.6 points); "
                    "look at training.grpo.sft_replay_weight, training.grpo.refusal_weight, "
                    "data.grpo_safety_per_category, training.grpo.learning_rate")


def test_a_ceiling_metric_is_lost_by_the_step_that_raised_it():
    evals = {**EVALS, "grpo": {**EVALS["grpo"], "over_refusal_rate": 0.2},
             "bundle-fp": {**EVALS["bundle-fp"], "over_refusal_rate": 0.2}}
    (line,) = failed_gate_advice([parse_gate("over_refusal_rate <= 0.1")], evals, CHAIN)
    assert line.startswith("over_refusal_rate <= 0.1 failed (0.200): GRPO lost it (dpo 0.104 -> grpo 0.200, +9.6")


def test_a_quantized_bundle_that_lost_it_points_at_quantization():
    (line,) = failed_gate_advice([parse_gate("task_accuracy >= 0.5")], EVALS, [*CHAIN, "bundle-gptq"])
    assert line.startswith("task_accuracy >= 0.5 failed (0.410): quantization lost it (bundle-fp 0.700 -> "
                           "bundle-gptq 0.410, -29.0 points); look at quantize.group_size")


def test_a_metric_no_model_reached_names_the_best_and_the_teacher():
    (line,) = failed_gate_advice([parse_gate("task_accuracy >= 0.9")], EVALS, CHAIN)
    assert line.startswith("task_accuracy >= 0.9 failed (0.700): no model on the chain reached it (best 0.700, "
                           "grpo); look at training.sft.")
    (missing,) = failed_gate_advice([parse_gate("toxicity <= 0.1")], EVALS, CHAIN)
    assert missing == "toxicity <= 0.1: no model on the chain measured toxicity"


def test_every_key_the_advice_names_is_a_recipe_key():
    import dataclasses
    import typing

    from flows.gate_advice import STAGE_KEYS
    from flows.recipe import Recipe

    def field_type(cls, name):
        hints = typing.get_type_hints(cls)
        assert name in {f.name for f in dataclasses.fields(cls)}, f"{cls.__name__} has no {name}"
        kind = hints[name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0] if args else kind

    for table in STAGE_KEYS.values():
        for keys in table.values():
            for key in keys:
                cls = Recipe
                for part in key.split("."):
                    cls = field_type(cls, part)


def test_json_answers_never_learned_point_at_the_json_chats_in_sft():
    """A gate on the JSON answers that no model reached names SFT's JSON chats, the data that teaches them."""
    evals = {name: {**metrics, "constrained_task_accuracy": 0.0} for name, metrics in EVALS.items()}
    (line,) = failed_gate_advice([parse_gate("constrained_task_accuracy >= 0.5")], evals, CHAIN)
    assert line.startswith("constrained_task_accuracy >= 0.5 failed (0.000): no model on the chain reached it")
    assert line.endswith("look at data.sft_json_per_task, training.sft.max_steps")
