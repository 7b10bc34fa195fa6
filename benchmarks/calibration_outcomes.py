"""The rollout calibration's results: one record per rollout, and the tables made of them."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# the adapter scenarios with trained adapters, on the pipeline's base bundle as champion (calibration_adapters.py)
TRAINED_ADAPTER_SCENARIOS = ("adapter-trained-aa", "adapter-refusals")
SCENARIOS = ("aa", "ttft", "ttft25", "itl", "errors", "sampled", "sampled-mild", "slice", "refusals", "accuracy",
             "slow", "adapter-aa", "adapter-task", "adapter-ttft25", *TRAINED_ADAPTER_SCENARIOS)
NULL_SCENARIOS = ("aa", "adapter-aa", "adapter-trained-aa")  # A/A: anything but a promotion is a false alarm
TITLES = {"aa": "A/A (champion vs itself)", "ttft": "TTFT +50% (gateway delay on the canary)",
          "ttft25": "TTFT +25% (gateway delay on the canary)",
          "itl": "ITL +30% only (gateway token-gap floor on the canary; same TTFT)",
          "errors": "5xx +3% (gateway abort on the canary)",
          "sampled": "lost sampled accuracy only (champion's weights, a hotter default temperature)",
          "sampled-mild": "a few points of sampled accuracy lost (champion's weights, a slightly hotter default)",
          "slice": "one slice only (champion's weights; its record loses half of one slice)",
          "refusals": "lost refusals (drill bundle)",
          "accuracy": "lost task accuracy (base model)", "slow": "slow candidate (HF forward, 1 sequence)",
          "adapter-aa": "adapter A/A (the champion adapter vs itself, in the same replica)",
          "adapter-task": "adapter that lost the task (its B ×25)",
          "adapter-ttft25": "adapter TTFT +25% (gateway delay on the lane's canary)",
          "adapter-trained-aa": "trained adapter A/A (the pipeline's SFT adapter vs itself)",
          "adapter-refusals": "adapter trained to drop refusals (SFT with refusals replaced)"}


@dataclass
class RunOutcome:
    scenario: str
    run: int
    rollout_id: str
    phase: str  # promoted | rolled_back | paused | awaiting_approval | timeout | error
    reason: str
    seconds: float
    decided_at: str = ""  # the analysis that decided: "shadow", "canary 10%", ...
    looks: int = 0
    extensions: int = 0
    fired: list[str] = field(default_factory=list)  # failed gates of the deciding analysis
    inconclusive: list[str] = field(default_factory=list)  # inconclusive gates of the deciding analysis
    analyses: list[dict[str, Any]] = field(default_factory=list)
    fault: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    load: list[float] = field(default_factory=list)  # 1-minute load average at the start and at the end


def summarise(scenario: str, run: int, state, seconds: float, fault: dict) -> RunOutcome:
    phase = state.phase
    out = RunOutcome(scenario, run, state.id, phase, state.reason, seconds, looks=len(state.analyses),
                     extensions=sum(d["kind"] == "extend" for d in state.decisions), fault=fault)
    for a in state.analyses:
        out.analyses.append({"look": a["look"], "phase": a["phase"], "weight": a["weight"], "outcome": a["outcome"],
                             "traffic": a.get("traffic", []), "metrics": a.get("metrics", {}),
                             "verdicts": [{k: v[k] for k in ("gate", "outcome", "candidate", "baseline", "p_value",
                                                             "samples", "min_samples", "critical", "reason")}
                                          for v in a["verdicts"]]})
    if state.analyses and phase in ("rolled_back", "paused", "promoted", "awaiting_approval"):
        last = state.analyses[-1]
        out.decided_at = last["phase"] + (f" {last['weight']:g}%" if last["weight"] else "")
        out.fired = [v["gate"] for v in last["verdicts"] if v["outcome"] == "fail"]
        out.inconclusive = [v["gate"] for v in last["verdicts"] if v["outcome"] == "inconclusive"]
    if phase == "rolled_back" and not out.fired:  # not an analysis: a dead candidate or a person
        out.decided_at = "controller"
        out.fired = ["replicas_unavailable" if "unavailable" in state.reason else "other"]
    return out


def _share(n: int, k: int) -> str:
    return f"{n}/{k}"


def markdown(outcomes: list[RunOutcome], scenario_seconds: dict[str, float], plan, notes: list[str]) -> str:
    by: dict[str, list[RunOutcome]] = {}
    for o in outcomes:
        by.setdefault(o.scenario, []).append(o)
    rows = ["| scenario | K | promoted | rolled back | paused | timeout/error | result | gates failed at the deciding "
            "look, inconclusive for a pause (runs) | decided at (runs) | min per rollout (median, max) | "
            "scenario min | load (1-min, range) |",
            "|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|---|"]
    for name in SCENARIOS:
        runs = by.get(name)
        if not runs:
            continue
        k = len(runs)
        count = Counter(o.phase for o in runs)
        other = k - count["promoted"] - count["rolled_back"] - count["paused"]
        if name in NULL_SCENARIOS:
            result = (f"false rollbacks {_share(count['rolled_back'], k)}, false pauses "
                      f"{_share(count['paused'], k)}")
        else:
            result = (f"detected {_share(count['rolled_back'], k)} (rolled back), held "
                      f"{_share(count['paused'], k)} (paused), missed {_share(count['promoted'], k)}")
        gates = Counter(g for o in runs if o.phase != "promoted" for g in (o.fired or o.inconclusive))
        where = Counter(o.decided_at or o.phase for o in runs if o.phase != "promoted")
        minutes = [o.seconds / 60 for o in runs]
        rows.append(f"| {TITLES[name]} | {k} | {count['promoted']} | {count['rolled_back']} | {count['paused']} | "
                    f"{other} | {result} | {', '.join(f'{g} ({n})' for g, n in gates.most_common()) or '–'} | "
                    f"{', '.join(f'{w} ({n})' for w, n in where.most_common()) or '–'} | "
                    f"{statistics.median(minutes):.1f}, {max(minutes):.1f} | "
                    f"{scenario_seconds.get(name, sum(o.seconds for o in runs)) / 60:.1f} | {_load_range(runs)} |")
    total = sum(scenario_seconds.values()) / 60
    text = ["\n".join(rows), "",
            f"Total: {len(outcomes)} rollouts in {total:.1f} min (scenario minutes include starting its replicas).",
            "", f"Plan: {describe_plan(plan)}."]
    if notes:
        text += [""] + [f"- {n}" for n in notes]
    text += ["", gate_table(by)]
    return "\n".join(text) + "\n"


def _load_range(runs: list[RunOutcome]) -> str:
    loads = [x for o in runs for x in o.load]
    return f"{min(loads):.1f}–{max(loads):.1f}" if loads else "–"


def describe_plan(plan) -> str:
    steps = " → ".join(f"{s.weight:g}% {s.seconds:g} s (≥ {s.min_requests} requests)" for s in plan.steps)
    g = plan.gates
    return (f"baseline {plan.baseline_seconds:g} s (≥ {plan.baseline_min_pairs} pairs), shadow "
            f"{plan.shadow_seconds:g} s (≥ {plan.shadow_min_pairs} pairs), canary {steps}, "
            f"{plan.max_extensions} extension(s) + {plan.max_evidence_extensions} evidence extension(s), alpha "
            f"{g.alpha:g} / {plan.most_looks} looks per gate; 5xx ≤ +{g.max_error_rate_increase:g} (power "
            f"{g.detect_power:g} to fail +{g.detect_error_rate_increase:g}), TTFT/ITL ≤ ×{g.max_ttft_ratio:g}/"
            f"×{g.max_itl_ratio:g} (to fail ×{g.detect_ttft_ratio:g}/×{g.detect_itl_ratio:g}), "
            f"ms/token p95 ≤ ×{g.max_ms_per_token_p95_ratio:g}, agreement ≤ "
            f"+{g.max_agreement_drop:g}, probes {plan.probes.tasks} tasks + {plan.probes.safety} safety (accuracy, "
            f"refusals ≤ +{g.max_accuracy_drop:g}, +{g.max_refusal_drop:g}), eval record "
            f"{'required' if g.require_eval_record else 'optional'}")


def gate_table(by: dict[str, list[RunOutcome]]) -> str:
    """Every verdict of every analysis, counted per scenario, gate and phase: pass / inconclusive / fail, and the
    range of the measured values (ratios for latency gates, rates for the others)."""
    rows = ["| scenario | phase | gate | pass | inconclusive | fail | candidate value (min–median–max) | "
            "smallest p |", "|---|---|---|---:|---:|---:|---|---:|"]
    for name in SCENARIOS:
        counts: dict[tuple[str, str], Counter] = {}
        values: dict[tuple[str, str], list[float]] = {}
        pvals: dict[tuple[str, str], list[float]] = {}
        for o in by.get(name, []):
            for a in o.analyses:
                where = a["phase"] + (f" {a['weight']:g}%" if a["weight"] else "")
                for v in a["verdicts"]:
                    key = (where, v["gate"])
                    counts.setdefault(key, Counter())[v["outcome"]] += 1
                    if isinstance(v["candidate"], (int, float)):
                        values.setdefault(key, []).append(float(v["candidate"]))
                    if isinstance(v["p_value"], (int, float)):
                        pvals.setdefault(key, []).append(float(v["p_value"]))
        for (where, gate), c in counts.items():
            vals = values.get((where, gate), [])
            span = f"{min(vals):.3g}–{statistics.median(vals):.3g}–{max(vals):.3g}" if vals else "–"
            p = f"{min(pvals[(where, gate)]):.2g}" if pvals.get((where, gate)) else "–"
            rows.append(f"| {name} | {where} | {gate} | {c['pass']} | {c['inconclusive']} | {c['fail']} | {span} | "
                        f"{p} |")
    return "\n".join(rows)
