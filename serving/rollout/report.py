"""What a person reads about a rollout: the timeline, the gate table per analysis, the version row's summary
against the champion, a plot, and the pairs where champion and candidate disagreed most. Plain functions of
the persisted state (``recording.py`` puts them in MLflow)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from serving.rollout.state import RolloutState, StateFile


def _clock(state: RolloutState, at: float) -> str:
    return f"+{at - state.started_at:6.1f}s"


def timeline_lines(state: RolloutState) -> list[str]:
    lines = []
    for entry in state.decisions:
        what = entry["detail"] if entry["kind"] == "alias" else f"{entry.get('from', '')} → {entry['to']}"
        lines.append(f"{_clock(state, entry['at'])}  {entry['kind']:<8} {what}  ({entry['cause']}; {entry['actor']})")
    return lines


def timeline_markdown(state: RolloutState) -> str:
    spec = state.spec
    rows = ["| time | kind | change | cause | actor |", "|---|---|---|---|---|"]
    for entry in state.decisions:
        what = entry["detail"] if entry["kind"] == "alias" else f"{entry.get('from', '')} → {entry['to']}"
        stamp = time.strftime("%H:%M:%S", time.localtime(entry["at"]))
        rows.append(f"| {stamp} ({_clock(state, entry['at']).strip()}) | {entry['kind']} | {what} | "
                    f"{_cell(entry['cause'])} | {entry['actor']} |")
    reason = f" ({state.reason})" if state.reason else ""
    head = (f"# Rollout {state.id}\n\n{spec.model_name}: candidate v{spec.candidate_version} against champion "
            f"v{spec.champion_version}; now **{state.phase}**{reason}\n\n")
    return head + "\n".join(rows) + "\n"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def comparison_markdown(state: RolloutState) -> str:
    """One row per gate and analysis: candidate value, baseline, rule, verdict, p-value, samples."""
    out = [f"# Gates: v{state.spec.candidate_version} vs champion v{state.spec.champion_version}\n"]
    for analysis in state.analyses:
        out.append(f"\n## Analysis {analysis['look']}: {analysis['phase']}"
                   + (f" at {analysis['weight']:g}%" if analysis["weight"] else "")
                   + f" — {analysis['outcome']}\n")
        out.append("| gate | candidate | baseline | rule | verdict | p | samples | why |")
        out.append("|---|---|---|---|---|---|---|---|")
        waived = set(analysis.get("waived") or [])
        for v in analysis["verdicts"]:
            out.append(f"| {v['gate']} | {_num(v['candidate'])} | {_num(v['baseline'])} | {_cell(v['threshold'])} | "
                       f"**{v['outcome']}**{'' if v['critical'] else ' (advisory)'}"
                       f"{' (waived)' if v['gate'] in waived else ''} | {_num(v['p_value'])} | "
                       f"{v['samples']}/{v['min_samples']} | {_cell(v['reason'])} |")
        if analysis.get("traffic"):
            out.append("\nTraffic in the window: " + ", ".join(
                f"{t['variant']} v{t['version']} {t['requests']} requests from {t['keys']} keys"
                for t in analysis["traffic"]) + ".")
        if analysis.get("advice"):
            out.append(f"\n{analysis['advice']}")
    return "\n".join(out) + "\n"


def _num(value: Any) -> str:
    return "–" if value is None else f"{value:.3g}"


def vs_champion(state: RolloutState) -> str:
    """The numbers a person wants on the version row: agreement vs floor, latency ratios, accuracy delta."""
    parts = []
    latest: dict[str, Any] = {}
    for a in state.analyses:
        for v in a["verdicts"]:
            latest[v["gate"]] = v
    if "agreement" in latest and latest["agreement"]["candidate"] is not None:
        v = latest["agreement"]
        floor = 1 - v["baseline"] if v["baseline"] is not None else None
        parts.append(f"agree {1 - v['candidate']:.2f}" + (f" (floor {floor:.2f})" if floor is not None else ""))
    for gate, label in (("ttft_ratio", "TTFT"), ("itl_ratio", "ITL"), ("ms_per_token_p95_ratio", "ms/tok p95")):
        if gate in latest and latest[gate]["candidate"] is not None:
            parts.append(f"{label} ×{latest[gate]['candidate']:.2f}")
    if "probe_accuracy" in latest and latest["probe_accuracy"]["candidate"] is not None:
        v = latest["probe_accuracy"]
        parts.append(f"acc {(v['baseline'] - v['candidate']) * 100:+.0f} pts")
    if "probe_sampled_accuracy" in latest and latest["probe_sampled_accuracy"]["candidate"] is not None:
        v = latest["probe_sampled_accuracy"]  # rates of wrong answers: champion's minus candidate's is the change
        parts.append(f"sampled acc {(v['baseline'] - v['candidate']) * 100:+.0f} pts")
    if "error_rate" in latest and latest["error_rate"]["candidate"] is not None:
        parts.append(f"5xx {latest['error_rate']['candidate']:.3f}")
    return " · ".join(parts) or "–"


def disagreements_markdown(state: RolloutState, pairs: list[dict[str, Any]]) -> str:
    out = [f"# Where v{state.spec.candidate_version} and champion v{state.spec.champion_version} disagree most\n",
           "Refusal flips first, then different answers, then the least similar texts.\n"]
    for i, pair in enumerate(pairs, 1):
        out.append(f"\n## {i}. request {pair['request_id']}\n")
        out.append(f"- answer: champion `{pair['answer_primary']}` vs candidate `{pair['answer_shadow']}`; refusal: "
                   f"champion {bool(pair['refusal_primary'])}, candidate {bool(pair['refusal_shadow'])}; similarity "
                   f"{pair['similarity']:.2f}; first divergence at token {pair['first_divergence']}\n")
        out.append(f"**Prompt**\n\n```\n{pair['prompt']}\n```\n")
        out.append(f"**Champion**\n\n```\n{pair['primary_text']}\n```\n")
        out.append(f"**Candidate**\n\n```\n{pair['shadow_text']}\n```\n")
    if not pairs:
        out.append("\nNo disagreements recorded.\n")
    return "\n".join(out)


def comparison_figure(state: RolloutState):
    """Candidate against what it was judged on, per analysis: the baseline replica in canary steps (the champion
    in shadow), latency medians and p95s, error rates, agreement vs floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    looks = [a["look"] for a in state.analyses]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [("latency p50 and p95 (ms)", ("ttft_ms_p50", "ttft_ms_p95", "itl_ms_p95", "ms_per_token_p95")),
              ("5xx rate", ("error_rate",)), ("agreement", ())]
    for ax, (title, names) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("analysis")
        for name in names:
            for who, style in (("candidate", "-o"), ("champion", "--s"), ("baseline", ":^")):
                ys = [a["metrics"].get(f"{who}.{name}") for a in state.analyses]
                if any(y is not None for y in ys):
                    ax.plot(looks, [float("nan") if y is None else y for y in ys], style, label=f"{who} {name}")
        if title == "agreement":
            ys = [a["metrics"].get("gate.agreement") for a in state.analyses]
            floors = [a["metrics"].get("gate.agreement.baseline") for a in state.analyses]
            # the gate measures disagreement; plot agreement, which reads more naturally
            ax.plot(looks, [float("nan") if y is None else 1 - y for y in ys], "-o", label="candidate vs champion")
            ax.plot(looks, [float("nan") if y is None else 1 - y for y in floors], "--s", label="noise floor")
            ax.set_ylim(0, 1.05)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{state.spec.model_name}: v{state.spec.candidate_version} vs v{state.spec.champion_version} "
                 f"({state.phase})")
    fig.tight_layout()
    return fig


def rollout_markdown(directory: str | Path) -> str:
    """The timeline and the comparison table of the rollout kept in ``directory`` (a Prefect artifact)."""
    state = StateFile(directory).load()
    return timeline_markdown(state) + "\n" + comparison_markdown(state)
