"""The pipeline's closing report: which stages ran or came from cache, and the eval figures per model.

One record feeds three views — the terminal table, the markdown logged to MLflow and Prefect, and the
JSON the flow returns — so they can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flows.stage_runner import StageOutput

# Columns of the eval table, in reading order; a metric a suite did not produce shows as "–".
HEADLINE_METRICS = (
    "task_accuracy",
    "sampled_task_accuracy",
    "format_adherence",
    "preference_accuracy",
    "refusal_rate",
    "over_refusal_rate",
    "constrained_task_accuracy",
    "perplexity",
)
# Short column titles for the terminal table (full metric names stay in markdown and MLflow).
SHORT_TITLES = {
    "task_accuracy": "task acc",
    "sampled_task_accuracy": "sampled acc",
    "format_adherence": "format",
    "preference_accuracy": "pref acc",
    "refusal_rate": "refusal",
    "over_refusal_rate": "over-refusal",
    "constrained_task_accuracy": "json acc",
    "perplexity": "ppl",
}

# Metrics that are rates in [0, 1]: a stage's change shows in points; "over-refusal" and perplexity fall
# when things improve, and perplexity is no rate, so it is left out of the change line.
RATE_METRICS = tuple(m for m in HEADLINE_METRICS if m != "perplexity")


CURVE_FIRST, CURVE_LAST = "heldout_greedy_accuracy_first", "heldout_greedy_accuracy_last"


def stage_change_note(label: str, input_label: str, after: dict[str, float], before: dict[str, float],
                      training: dict[str, float] | None = None) -> str:
    """``grpo vs its input (dpo): task acc +0.0, sampled acc +6.1, ... points; held-out greedy during the stage
    0.891 -> 0.938``: what one stage changed on the held-out evals, the figure a promotion decision starts
    from, and (from the training stage's own metrics) where its held-out curve started and ended. Metrics
    either side lacks are left out."""
    changes = [f"{SHORT_TITLES[m]} {(after[m] - before[m]) * 100:+.1f}" for m in RATE_METRICS
               if m in after and m in before]
    summary = ", ".join(changes) + " points" if changes else "no shared metrics"
    if training and CURVE_FIRST in training and CURVE_LAST in training:
        summary += f"; held-out greedy during the stage {training[CURVE_FIRST]:.3f} -> {training[CURVE_LAST]:.3f}"
    return f"{label} vs its input ({input_label}): {summary}"


SLICED_METRIC = "task_accuracy"


def _slice_order(label: str) -> tuple[int, int, str]:
    """Tasks first, then widths, then carries, each in numeric order (``carries-10`` after ``carries-2``)."""
    kind, _, number = label.rpartition("-")
    rank = {"digits": 1, "carries": 2}.get(kind, 0)
    return (rank, int(number) if rank and number.isdigit() else 0, label)


def slice_table(evals: dict[str, dict[str, float]], metric: str = SLICED_METRIC
                ) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """``metric`` per slice (task, digits, carries) for every evaluated model: the columns and one row per
    model. Where each stage gained, not only how much; empty when no model has more than one slice."""
    prefix = f"{metric}/"
    labels = sorted({key[len(prefix):] for metrics in evals.values() for key in metrics if key.startswith(prefix)},
                    key=_slice_order)
    if len(labels) < 2:
        return [], []
    return labels, [(model, [_fmt(metrics.get(prefix + label)) for label in labels])
                    for model, metrics in evals.items()]


@dataclass
class PipelineReport:
    recipe_name: str
    stages: list[StageOutput] = field(default_factory=list)
    evals: dict[str, StageOutput] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    total_seconds: float = 0.0

    def add_stage(self, output: StageOutput) -> None:
        self.stages.append(output)

    def add_eval(self, label: str, output: StageOutput) -> None:
        self.evals[label] = output
        self.stages.append(output)

    def eval_rows(self) -> list[tuple[str, list[str]]]:
        return [(label, [_fmt(out.metrics.get(m)) for m in HEADLINE_METRICS]) for label, out in self.evals.items()]

    def to_markdown(self) -> str:
        lines = [f"# {self.recipe_name}: lifecycle results", "", "| model | " + " | ".join(HEADLINE_METRICS) + " |",
                 "|---|" + "---|" * len(HEADLINE_METRICS)]
        lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in self.eval_rows()]
        columns, rows = slice_table({label: out.metrics for label, out in self.evals.items()})
        if columns:
            lines += ["", f"{SLICED_METRIC} by slice (greedy):", "", "| model | " + " | ".join(columns) + " |",
                      "|---|" + "---:|" * len(columns)]
            lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
        lines += ["", "| stage | seconds | from cache | output |", "|---|---|---|---|"]
        lines += [f"| {s.stage} | {s.seconds:.1f} | {'yes' if s.cached else 'no'} | `{s.path}` |" for s in self.stages]
        lines += ["", f"Total wall time: {self.total_seconds:.1f} s"]
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe_name,
            "evals": {label: out.metrics for label, out in self.evals.items()},
            "stages": {s.stage: {"path": s.path, "seconds": s.seconds, "key": s.key, "cached": s.cached,
                                 "mlflow_run_id": s.mlflow_run_id, **_plain(s.info)} for s in self.stages},
            "notes": list(self.notes),
            "total_seconds": round(self.total_seconds, 1),
        }


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    """Stage info minus the long text fields that belong in the markdown, not the JSON summary."""
    return {k: v for k, v in info.items() if k not in ("table", "fidelity_table")}


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.3f}"


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


def adapter_note(adapter: StageOutput, served: dict[str, float], merged: dict[str, float], last: str) -> str:
    """The report's line on the adapter form: how it was stacked, and its evals as served beside the merged
    chain's (stacking is exact, so they differ by float rounding at most; a gap says something is wrong)."""
    pairs = ", ".join(f"{m} {_fmt(served.get(m))} (merged {last}: {_fmt(merged.get(m))})"
                      for m in HEADLINE_METRICS if m in served)
    return f"adapter: {adapter.info.get('summary', adapter.path)}; base + adapter as served: {pairs}"
