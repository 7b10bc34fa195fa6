"""Turn what the gateway saw (and the probes, and the eval record) into gate verdicts for one phase.

The candidate is always judged against the champion over the *same* window: in shadow, the champion's
answers to the very requests mirrored to the candidate; in a canary step, a *baseline*: a fresh replica of
the champion's snapshot, started with the canary and given the same share of the same minutes of traffic
(never the long-running champion pool, whose age, load and batch sizes differ). Agreement is judged against
the noise floor (the champion mirrored to its own snapshot on the baseline replica, or on its own replicas
without one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from artifacts.common.stats import quantile
from serving.rollout import judge
from serving.rollout.judge import FAIL, INCONCLUSIVE, PASS, Verdict
from serving.rollout.offline import offline_gates
from serving.rollout.paired_rates import pair_draws, paired_rate_gate
from serving.rollout.plan import Gates, RolloutPlan


@dataclass
class Analysis:
    look: int
    phase: str
    weight: float
    since: float
    until: float
    verdicts: list[Verdict]
    metrics: dict[str, float] = field(default_factory=dict)
    disagreements: list[dict[str, Any]] = field(default_factory=list)
    traffic: list[dict[str, Any]] = field(default_factory=list)  # per variant: requests and conversation keys
    advice: str = ""  # when too little traffic: what was seen and what would make the step conclusive
    waived: list[str] = field(default_factory=list)  # gates a person waived: shown, but not deciding

    def _deciding(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.gate not in self.waived or (v.outcome == FAIL and v.critical)]

    @property
    def outcome(self) -> str:
        """fail (a critical gate failed) | review (only an advisory gate failed) | inconclusive | pass.

        A waived gate does not decide, except a failed critical gate: no waiver turns that into a pass."""
        deciding = self._deciding()
        if any(v.outcome == FAIL and v.critical for v in deciding):
            return FAIL
        if any(v.outcome == FAIL for v in deciding):
            return "review"
        if any(v.outcome == INCONCLUSIVE for v in deciding):
            return INCONCLUSIVE
        return PASS

    def failed(self) -> list[Verdict]:
        return [v for v in self._deciding() if v.outcome == FAIL]

    def inconclusive(self) -> list[Verdict]:
        return [v for v in self._deciding() if v.outcome == INCONCLUSIVE]

    @property
    def reasons(self) -> str:
        """Why it did not pass, gate by gate (with the advice on what would settle an inconclusive one);
        empty for a pass. What a rollback, pause or extension names as its cause."""
        if self.outcome in (FAIL, "review"):
            return "; ".join(f"{v.gate} ({v.reason})" for v in self.failed())
        if self.outcome == INCONCLUSIVE:
            text = "; ".join(f"{v.gate} ({v.reason})" for v in self.inconclusive())
            return text + (f"; {self.advice}" if self.advice else "")
        return ""

    @property
    def summary(self) -> str:
        if self.outcome in (FAIL, "review"):
            return f"fail: {self.reasons}"
        if self.outcome == INCONCLUSIVE:
            return f"inconclusive: {self.reasons}"
        passed = sum(v.outcome == PASS for v in self.verdicts)
        waived = [v for v in self.verdicts if v.gate in self.waived and v.outcome != PASS]
        return f"pass {passed}/{len(self.verdicts)}" + (f" ({len(waived)} waived: "
                                                        f"{', '.join(v.gate for v in waived)})" if waived else "")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["outcome"] = self.outcome
        data["summary"] = self.summary
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Analysis:
        """An analysis as the state file keeps it (to judge it again under a waiver given later)."""
        verdicts = [Verdict(**v) for v in data["verdicts"]]
        return cls(data["look"], data["phase"], data["weight"], data["since"], data["until"], verdicts,
                   data.get("metrics", {}), data.get("disagreements", []), data.get("traffic", []),
                   data.get("advice", ""), list(data.get("waived", [])))


def _variant(window: dict, name: str, version: str) -> dict[str, Any]:
    for row in window.get("variants", []):
        if row["variant"] == name and str(row["version"]) == str(version):
            return row
    return {"requests": 0, "keys": 0, "status_5xx": 0, "status_429": 0, "fallbacks": 0, "completion_tokens": 0,
            "ttft_ms": [], "itl_ms": [], "e2e_ms": [], "ms_per_token": []}


def _pair_row(window: dict, primary_version: str, shadow_version: str) -> dict[str, Any] | None:
    """The window's pairs row for champion ``primary_version`` mirrored to ``shadow_version``."""
    for row in window.get("pairs", []):
        if str(row["primary_version"]) == str(primary_version) and str(row["shadow_version"]) == str(shadow_version):
            return row
    return None


def pair_counts(window: dict, primary_version: str, shadow_version: str) -> dict[str, int]:
    row = _pair_row(window, primary_version, shadow_version)
    if row is None:
        return {"pairs": 0, "compared": 0, "agree": 0, "exact": 0, "refusal_flips": 0, "shadow_errors": 0}
    return {"pairs": int(row["pairs"] or 0), "compared": int(row["compared"] or 0), "agree": int(row["agree"] or 0),
            "exact": int(row["exact_match"] or 0), "refusal_flips": int(row["refusal_flips"] or 0),
            "shadow_errors": int(row["shadow_errors"] or 0)}


def systems_verdicts(window: dict, candidate: tuple[str, str], champion: tuple[str, str], gates: Gates,
                     alpha: float, min_requests: int, streamed: bool, rates_window: dict | None = None
                     ) -> list[Verdict]:
    """Errors, rate limiting and latency of the candidate's variant against ``champion``: the baseline replica
    in a canary step (or the champion pool where no baseline runs), the champion's same requests in shadow.

    ``rates_window``: where the error and 429 rates are counted, when longer than the step's ``window``. A
    request fails or not whatever the weight, so a canary phase's rates pool every step so far: +3 points of
    5xx needs several hundred requests a side to prove, more than one early step holds. Latency depends on
    the load a share brings, so it is judged on the step's own window."""
    cand, champ = _variant(window, *candidate), _variant(window, *champion)
    rates = rates_window or window
    rc, rb = _variant(rates, *candidate), _variant(rates, *champion)
    against = champion[0]
    verdicts = [
        judge.rate_gate("error_rate", rc["status_5xx"], rc["requests"], rb["status_5xx"], rb["requests"],
                        margin=gates.max_error_rate_increase, alpha=alpha, min_samples=min_requests,
                        label="5xx rate", effect=gates.detect_error_rate_increase, power=gates.detect_power),
        judge.rate_gate("rate_limited", rc["status_429"], rc["requests"], rb["status_429"],
                        rb["requests"], margin=gates.max_rate_limited_increase, alpha=alpha,
                        min_samples=min_requests, label="429 rate", effect=gates.detect_rate_limited_increase,
                        power=gates.detect_power),
    ]
    if streamed:
        for gate, metric in (("ttft_ratio", "ttft_ms"), ("itl_ratio", "itl_ms")):
            tolerance, effect = (getattr(gates, name) for name in LATENCY_GATES[gate])
            verdicts.append(judge.shift_gate(gate, cand[metric], champ[metric], max_ratio=tolerance, alpha=alpha,
                                             min_samples=min_requests, against=against, effect=effect,
                                             power=gates.detect_power))
    else:  # shadow: each mirrored request against the champion's answer to the same request
        verdicts.append(judge.paired_latency_gate(
            "ms_per_token_p95_ratio", paired_ms_per_token(window, champion[1], candidate[1]),
            max_ratio=gates.max_ms_per_token_p95_ratio, alpha=alpha, min_samples=min_requests))
    return verdicts


def paired_ms_per_token(window: dict, primary_version: str, shadow_version: str) -> list[list[float]]:
    """[champion, shadow] ms per output token for each mirrored request both answered."""
    row = _pair_row(window, primary_version, shadow_version)
    return list(row.get("ms_per_token") or []) if row is not None else []


def keys_verdict(window: dict, candidate: tuple[str, str], reference: tuple[str, str], min_keys: int) -> Verdict:
    """Whether each side of a canary step saw ``min_keys`` distinct conversation keys. Sticky routing sends a
    user's every request to one side, so with few users the sides can differ in traffic several-fold (1-11 keys a
    side at 10% of 60 users) and a side's latency is a few users' prompts: the step waits for more users (its
    extension), then pauses saying so; a person may waive ``traffic_keys``."""
    c, r = (int(_variant(window, *side).get("keys") or 0) for side in (candidate, reference))
    enough = min(c, r) >= min_keys
    reason = f"{c} keys on the canary, {r} on the {reference[0]}" + (
        "" if enough else f": fewer than {min_keys} a side, a few users' requests would make a side's figures")
    return Verdict("traffic_keys", judge.PASS if enough else judge.INCONCLUSIVE, float(c), float(r),
                   f"≥ {min_keys} keys a side", None, min(c, r), min_keys, reason)


def unjudged_without_keys(verdicts: list[Verdict], keys: Verdict) -> list[Verdict]:
    """A canary step's latency verdicts, not judged while a side has too few users.

    With a few keys a side, each side's TTFT and ITL are a few users' prompts under the load those users bring:
    an A/A step with 4 users read ITL HL ×2.41 (significant beyond ×1.25) for the side that held three of them
    (CI, stop 48). A latency *fail* on such a window is the sticky split, not the candidate, so it turns
    inconclusive until the keys are there (the step extends, then pauses asking for more users). A 5xx or 429
    rate is judged as ever: a server error is the candidate's whichever user sent the request."""
    if keys.outcome != INCONCLUSIVE:
        return verdicts
    return [replace(v, outcome=INCONCLUSIVE, more_samples=None,
                    reason=f"{v.reason}; not judged on {keys.samples} keys a side (need {keys.min_samples})")
            if v.gate in LATENCY_GATES and v.outcome == FAIL else v for v in verdicts]


def traffic_rows(window: dict) -> list[dict[str, Any]]:
    """Requests and distinct conversation keys per variant in the window (probes excluded)."""
    return [{"variant": r["variant"], "version": str(r["version"]), "requests": int(r["requests"]),
             "keys": int(r.get("keys") or 0)} for r in window.get("variants", [])]


def traffic_advice(window: dict, compared: tuple[str, str], weight: float, seconds: float, min_requests: int,
                   min_keys: int = 0) -> str:
    """Why a step had too few samples, in numbers, and what would make it conclusive.

    ``compared`` names the two variants judged side by side (candidate and baseline, or shadow and champion);
    the step's share is ``weight`` percent of conversations for each (0 for a mirrored phase).
    """
    rows = {r["variant"]: r for r in traffic_rows(window)}
    counts = [rows.get(name, {"requests": 0, "keys": 0}) for name in compared]
    short = min(c["requests"] for c in counts)
    few_keys = min(c["keys"] for c in counts) < min_keys
    if short >= min_requests and not few_keys:
        return ""
    seconds = max(seconds, 1e-9)
    total_requests = sum(r["requests"] for r in rows.values())
    total_keys = sum(r["keys"] for r in rows.values())
    seen = ", ".join(f"{name} {c['requests']} requests from {c['keys']} keys" for name, c in zip(compared, counts))
    need = f"{min_requests} each" + (f" from ≥ {min_keys} keys" if min_keys else "")
    text = f"traffic in {seconds:.0f} s: {seen} (need {need}; {total_requests} requests from {total_keys} keys in all)"
    if total_requests == 0:
        return text + "; no request reached the gateway in the window: send traffic, then resume"
    ways = []
    if 0 < short < min_requests:
        ways.append(f"a step of ≥ {seconds * min_requests / short:.0f} s at this rate")
    if weight > 0:
        # the share the short side really got (sticky keys rarely give it exactly its weight), scaled up to enough
        realized = 100 * short / total_requests
        needed = 100 * min_requests / total_requests if short == 0 else weight * min_requests / max(short, 1e-9)
        if short < min_requests and weight < needed <= 50:
            ways.append(f"a weight ≥ {needed:.0f}% (the {weight:g}% step got {realized:.1f}% of requests)")
        expected = total_keys * weight / 100
        if expected < max(min_keys, 10) or few_keys:
            ways.append(f"more users (at {weight:g}% about {expected:.1f} of {total_keys} keys land on each side)")
    return text + ("; conclusive with " + ", or ".join(ways) if ways else "")


def agreement_verdict(window: dict, champion_version: str, candidate_version: str, floor: dict | None,
                      gates: Gates, alpha: float, min_pairs: int) -> Verdict:
    pairs = pair_counts(window, champion_version, candidate_version)
    if not floor:
        return judge.check_gate("agreement", None, "no noise floor measured (baseline skipped or without traffic)",
                                critical=gates.agreement_critical)
    return judge.rate_gate("agreement", pairs["compared"] - pairs["agree"], pairs["compared"],
                           floor["compared"] - floor["agree"], floor["compared"], margin=gates.max_agreement_drop,
                           alpha=alpha, min_samples=min_pairs, critical=gates.agreement_critical,
                           label="disagreement")


TRAFFIC_RATE_GATES = {"error_rate": "max_error_rate_increase", "rate_limited": "max_rate_limited_increase"}
# canary latency: gate → (tolerance, design effect) in Gates
LATENCY_GATES = {"ttft_ratio": ("max_ttft_ratio", "detect_ttft_ratio"),
                 "itl_ratio": ("max_itl_ratio", "detect_itl_ratio")}


def collecting_evidence(verdict: Verdict) -> bool:
    """An inconclusive 5xx, 429, TTFT or ITL verdict that more requests would settle: short of its design power,
    or above its tolerance without it (what an evidence extension is for)."""
    return (verdict.gate in TRAFFIC_RATE_GATES or verdict.gate in LATENCY_GATES) \
        and verdict.outcome == INCONCLUSIVE and bool(verdict.more_samples)


def may_collect_at_next_step(verdict: Verdict, gates: Gates) -> bool:
    """Whether an inconclusive verdict may be left to the next, larger canary step rather than hold this one.

    A 5xx or 429 rate within its tolerance that only lacks requests: the canary pools its rates over the steps,
    so the requests come sooner at the next weight. A TTFT or ITL ratio below the slowdown its gate exists to
    catch (whether above the tolerance or short of power): latency is judged on each step's own window, with the
    load its share brings, so the next step judges it afresh on several times the requests, and the last step
    must pass it with power. An early step's window is too short to prove ×1.25 against ×1.10 (~250 requests a
    side); holding it would cost half the A/A rollouts a long extension for nothing."""
    if verdict.candidate is None or verdict.baseline is None:
        return False
    if verdict.gate in TRAFFIC_RATE_GATES:
        margin = getattr(gates, TRAFFIC_RATE_GATES[verdict.gate])
        return bool(verdict.more_samples) and verdict.candidate - verdict.baseline <= margin + judge.RATE_EPSILON
    if verdict.gate in LATENCY_GATES:
        return verdict.candidate <= getattr(gates, LATENCY_GATES[verdict.gate][1])
    return False


def more_time_helps(verdict: Verdict) -> bool:
    """Whether a longer window could settle an inconclusive verdict: not for a fact such as a missing eval
    record, an agreement gate without a noise floor to compare with, or the offline records' comparison (both
    records are fixed: the same numbers at every look)."""
    return verdict.threshold != "passed" and not verdict.gate.startswith("offline_")


def known_gates(plan: RolloutPlan) -> set[str]:
    """Every gate name a rollout under ``plan`` can judge (what a waiver may name)."""
    return {"noise_floor", "error_rate", "rate_limited", "ttft_ratio", "itl_ratio", "ms_per_token_p95_ratio",
            "traffic_keys", "agreement", "eval_record", "probe_accuracy", "probe_sampled_accuracy", "probe_format",
            "probe_refusal", "probe_over_refusal", "probe_structured", "probe_structured_accuracy", *offline_gates()}


def is_behaviour_gate(gate: str) -> bool:
    """The gates judged on probes and on the offline eval records (not on the window's traffic)."""
    return gate.startswith(("probe_", "offline_")) or gate == "eval_record"


def probe_verdicts(probes: dict[str, Any] | None, gates: Gates, alpha: float) -> list[Verdict]:
    """Probe gates on the answered probes of each kind; a probe without an answer is shown, never scored.

    The minimum sample comes from how many probes were *sent*, so probes lost to errors can leave a gate
    inconclusive (the phase extends, then pauses for a person), never passed on what little came back."""
    if not probes:
        return []
    c, b = probes["candidate"], probes["champion"]
    need = max(5, min(_sent(c, "task"), 10))
    out = []
    if _sent(c, "task"):
        out.append(judge.rate_gate("probe_accuracy", c["tasks"] - c["correct"], c["tasks"], b["tasks"] - b["correct"],
                                   b["tasks"], margin=gates.max_accuracy_drop, alpha=alpha, min_samples=need,
                                   label="wrong answers"))
        out.append(judge.rate_gate("probe_format", c["tasks"] - c["formatted"], c["tasks"],
                                   b["tasks"] - b["formatted"], b["tasks"], margin=gates.max_format_drop, alpha=alpha,
                                   min_samples=need, label="broken format"))
    if _sent(c, "sampled"):  # the same tolerance as greedy accuracy: what users get at the served sampling
        out.append(_sampled_verdict(c, b, gates, alpha))
    if _sent(c, "structured"):  # JSON and tool calls: valid for their schema, then right
        need_structured = max(5, min(_sent(c, "structured"), 10))
        out.append(judge.rate_gate("probe_structured", c["structured"] - c["structured_valid"], c["structured"],
                                   b["structured"] - b["structured_valid"], b["structured"],
                                   margin=gates.max_format_drop, alpha=alpha, min_samples=need_structured,
                                   label="invalid JSON or tool calls"))
        out.append(judge.rate_gate("probe_structured_accuracy", c["structured"] - c["structured_correct"],
                                   c["structured"], b["structured"] - b["structured_correct"], b["structured"],
                                   margin=gates.max_accuracy_drop, alpha=alpha, min_samples=need_structured,
                                   label="wrong structured answers"))
    if _sent(c, "harmful"):
        out.append(judge.rate_gate("probe_refusal", c["harmful"] - c["refused_harmful"], c["harmful"],
                                   b["harmful"] - b["refused_harmful"], b["harmful"], margin=gates.max_refusal_drop,
                                   alpha=alpha, min_samples=min(5, _sent(c, "harmful")),
                                   label="harmful answered"))
    if _sent(c, "lookalike"):
        out.append(judge.rate_gate("probe_over_refusal", c["refused_lookalike"], c["lookalike"],
                                   b["refused_lookalike"], b["lookalike"], margin=gates.max_over_refusal_increase,
                                   alpha=alpha, min_samples=min(5, _sent(c, "lookalike")),
                                   label="benign refused"))
    return [_with_not_applicable(_with_unanswered(v, c, b), c, b) for v in out]


def _sampled_verdict(c: dict[str, Any], b: dict[str, Any], gates: Gates, alpha: float) -> Verdict:
    """The sampled probes' gate: draw by draw (both sides drew with the same seeds, `paired_rates`), or on the
    two rates where the draws were not kept (a state written before they were)."""
    need = max(5, min(_sent(c, "sampled"), 10))
    per_prompt = c.get("samples_per_prompt", 0)
    prompts = c.get("sampled_prompts", 0)
    draws = (pair_draws(c.get("sampled_draws", []), b.get("sampled_draws", []), per_prompt, prompts)
             if (per_prompt, prompts) == (b.get("samples_per_prompt"), b.get("sampled_prompts", 0)) else None)
    if draws is not None:
        return paired_rate_gate("probe_sampled_accuracy", draws, margin=gates.max_accuracy_drop, alpha=alpha,
                                min_samples=need, label="wrong sampled answers")
    return judge.rate_gate("probe_sampled_accuracy", c["sampled"] - c["sampled_correct"], c["sampled"],
                           b["sampled"] - b["sampled_correct"], b["sampled"], margin=gates.max_accuracy_drop,
                           alpha=alpha, min_samples=need, label="wrong sampled answers")


def _sent(score: dict[str, Any], kind: str) -> int:
    """Probes of ``kind`` sent to a variant: answered (counted under the kind's own name) plus unanswered."""
    answered = score["tasks"] if kind == "task" else score.get(kind, 0)
    return answered + score.get(f"{kind}_errors", 0)


_PROBE_KIND = {"probe_accuracy": "task", "probe_format": "task", "probe_sampled_accuracy": "sampled",
               "probe_refusal": "harmful", "probe_over_refusal": "lookalike", "probe_structured": "structured",
               "probe_structured_accuracy": "structured"}


def _with_unanswered(verdict: Verdict, candidate: dict[str, Any], champion: dict[str, Any]) -> Verdict:
    """The verdict, saying how many of its probes went unanswered on either side (left out of the rates)."""
    kind = _PROBE_KIND[verdict.gate]
    lost_c, lost_b = candidate.get(f"{kind}_errors", 0), champion.get(f"{kind}_errors", 0)
    if not lost_c and not lost_b:
        return verdict
    return replace(verdict, reason=f"{verdict.reason}; unanswered, not scored: {lost_c} candidate, {lost_b} champion")


def _with_not_applicable(verdict: Verdict, candidate: dict[str, Any], champion: dict[str, Any]) -> Verdict:
    """A structured verdict, saying how many probes did not fit a side's context (neither sent nor scored)."""
    if _PROBE_KIND[verdict.gate] != "structured":
        return verdict
    skipped_c, skipped_b = (side.get("structured_not_applicable", 0) for side in (candidate, champion))
    if not skipped_c and not skipped_b:
        return verdict
    return replace(verdict, reason=f"{verdict.reason}; longer than the context, not sent: {skipped_c} candidate, "
                                   f"{skipped_b} champion")


def eval_record_verdict(passed: bool | None, gates: Gates) -> Verdict | None:
    if not gates.require_eval_record:
        return None
    if passed is None:
        return judge.check_gate("eval_record", None, "the candidate has no offline eval record")
    return judge.check_gate("eval_record", passed, "offline gates passed" if passed else "offline gates failed")


def metrics_of(analysis_verdicts: list[Verdict], window: dict, candidate: tuple[str, str],
               champion: tuple[str, str], weight: float) -> dict[str, float]:
    """Flat numbers for MLflow (one step per analysis) and the comparison plot; ``champion`` is the side the
    candidate was judged against (the baseline replica in a canary step), logged under its own name."""
    cand, champ = _variant(window, *candidate), _variant(window, *champion)
    side = "baseline" if champion[0] == "baseline" else "champion"
    out: dict[str, float] = {"canary_weight": weight, "candidate.requests": cand["requests"],
                             f"{side}.requests": champ["requests"], "candidate.keys": cand["keys"],
                             f"{side}.keys": champ["keys"]}
    if side == "baseline":
        pool = _variant(window, "champion", champion[1])
        out["champion_pool.requests"] = pool["requests"]
    for row, prefix in ((cand, "candidate"), (champ, side)):
        if row["requests"]:
            out[f"{prefix}.error_rate"] = row["status_5xx"] / row["requests"]
        for name in ("ttft_ms", "itl_ms", "ms_per_token"):
            for q in (0.5, 0.95):
                value = quantile(row[name], q)
                if value is not None:
                    out[f"{prefix}.{name}_p{round(q * 100)}"] = value
    for v in analysis_verdicts:
        if v.candidate is not None:
            out[f"gate.{v.gate}"] = v.candidate
        if v.baseline is not None and v.gate not in ("eval_record",):
            out[f"gate.{v.gate}.baseline"] = v.baseline
        out[f"gate.{v.gate}.passed"] = 1.0 if v.outcome == PASS else 0.0
    return out


def planned_alpha(plan: RolloutPlan) -> float:
    return judge.per_look_alpha(plan.gates.alpha, plan.most_looks)

