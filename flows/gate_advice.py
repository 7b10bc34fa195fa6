"""What to do when a release fails its gates: which stage lost the metric, and which recipe keys to look at.

A failed gate used to end the run with "v2 failed its gates; nothing to roll out", and the user had to read the
eval table to find that GRPO, say, had cost 11.6 points of refusals. ``failed_gate_advice`` walks the chain
the bundle came from (base → SFT → DPO → GRPO → the bundle, and for a quantized bundle the full-precision one
before it) and names the step that moved the gate's metric furthest the wrong way once some model had passed
the gate, with the recipe keys that decide that stage's effect on that metric. Where no model passed it (the
metric was never good enough), it names the best model on the chain and the keys of the stage meant to teach it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from evals.gates import Gate

# The recipe keys that decide what a stage does to a metric; "*" for any metric the stage has no entry for.
STAGE_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "sft": {"*": ("training.sft.learning_rate", "training.sft.max_steps", "data.sft_per_task"),
            "refusal_rate": ("data.sft_safety_repeats", "data.safety_train_per_category", "training.sft.max_steps"),
            "over_refusal_rate": ("data.sft_safety_repeats", "data.safety_train_per_category"),
            "constrained_task_accuracy": ("data.sft_json_per_task", "training.sft.max_steps"),
            "json_schema_adherence": ("data.sft_json_per_task", "training.sft.max_steps")},
    "dpo": {"*": ("training.dpo.learning_rate", "training.dpo.beta", "training.dpo.max_steps"),
            "refusal_rate": ("training.dpo.learning_rate", "training.dpo.sft_weight", "training.dpo.beta"),
            "over_refusal_rate": ("data.safety_pref_lookalikes", "training.dpo.learning_rate"),
            "format_adherence": ("training.dpo.sft_weight", "training.dpo.learning_rate")},
    "grpo": {"*": ("training.grpo.learning_rate", "training.grpo.temperature", "training.grpo.max_steps"),
             "refusal_rate": ("training.grpo.sft_replay_weight", "training.grpo.refusal_weight",
                              "data.grpo_safety_per_category", "training.grpo.learning_rate"),
             "over_refusal_rate": ("training.grpo.sft_replay_weight", "training.grpo.refusal_weight",
                                   "data.grpo_safety_per_category"),
             "format_adherence": ("training.grpo.format_weight", "training.grpo.learning_rate")},
    "quantize": {"*": ("quantize.group_size", "quantize.calibration_samples", "quantize.methods")},
}
# The stage meant to teach a metric no step reached
TEACHER = {"refusal_rate": "sft", "over_refusal_rate": "dpo", "format_adherence": "sft",
           "preference_accuracy": "dpo", "constrained_task_accuracy": "sft", "json_schema_adherence": "sft"}


def keys_for(stage: str, metric: str) -> tuple[str, ...]:
    table = STAGE_KEYS.get(stage, {})
    return table.get(metric, table.get("*", ()))


def failed_gate_advice(failed: Sequence[Gate], evals: Mapping[str, Mapping[str, float]],
                       chain: Sequence[str]) -> list[str]:
    """One line per failed gate. ``evals``: metrics per eval label; ``chain``: the labels from the base to the
    released bundle, in order (``bundle-gptq`` after ``bundle-fp`` for a quantized release)."""
    lines = []
    for gate in failed:
        points = [(label, evals[label][gate.metric]) for label in chain
                  if label in evals and gate.metric in evals[label]]
        if not points:
            lines.append(f"{gate}: no model on the chain measured {gate.metric}")
            continue
        sign = 1.0 if gate.op == ">=" else -1.0  # >=: a drop is a loss; <=: a rise is
        passing = [i for i, (_, value) in enumerate(points) if sign * (value - gate.threshold) >= 0]
        # a loss counts from the first model that passed the gate: before it, the metric was not there to lose
        start = passing[0] if passing else len(points)
        moves = [(sign * (after - before), before_label, label, before, after)
                 for (before_label, before), (label, after) in zip(points[start:], points[start + 1:])
                 if _stage_of(label, before_label) != "bundle"]  # the same weights, bundled: no stage of its own
        worst = min(moves, default=None)
        measured = points[-1][1]
        if worst is not None and worst[0] < 0:
            _, before_label, label, before, after = worst
            stage = _stage_of(label, before_label)
            lines.append(f"{gate} failed ({measured:.3f}): {_name(stage)} lost it ({before_label} {before:.3f} -> "
                         f"{label} {after:.3f}, {(after - before) * 100:+.1f} points); look at "
                         f"{', '.join(keys_for(stage, gate.metric))}")
        else:
            best_label, best = max(points, key=lambda p: sign * p[1])
            stage = TEACHER.get(gate.metric, "sft")
            lines.append(f"{gate} failed ({measured:.3f}): no model on the chain reached it (best {best:.3f}, "
                         f"{best_label}); look at {', '.join(keys_for(stage, gate.metric))}")
    return lines


def _stage_of(label: str, before_label: str) -> str:
    """The stage a step of the chain stands for: a training stage by its label, a quantized bundle's step from the
    full-precision one as quantization, and bundling an unchanged model as nothing of its own (its input's)."""
    if label.startswith("bundle-") and before_label.startswith("bundle-"):
        return "quantize"
    if label.startswith("bundle-"):
        return "bundle"
    return label


def _name(stage: str) -> str:
    return {"sft": "SFT", "dpo": "DPO", "grpo": "GRPO", "quantize": "quantization", "bundle": "bundling"}.get(
        stage, stage)
