"""One look at the phase in progress, at the end of its window: the evidence gathered and judged into an
``Analysis`` (the controller then decides what follows from it).

The evidence: the gateway's observation window (the systems gates, shadow agreement against the noise floor),
the probes sent to champion and candidate alike, and the offline eval records the release stage left in the
registry. The gates themselves are in ``analysis.py``, their statistics in ``judge.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from serving.fleet.gateway_client import GatewayAdmin
from serving.fleet.gateway_group import GatewayGroup
from serving.rollout import analysis as A
from serving.rollout.analysis import Analysis
from serving.rollout.judge import FAIL, INCONCLUSIVE, PASS, Verdict
from serving.rollout.offline import offline_verdicts
from serving.rollout.plan import RolloutPlan
from serving.rollout.probes import load_probes, pool_sampled, run_probes
from serving.rollout.registry_console import RegistryConsole
from serving.rollout.state import BASELINE, CANARY, SHADOW, RolloutState


class PhaseJudge:
    def __init__(self, plan: RolloutPlan, gateway: GatewayAdmin | GatewayGroup, console: RegistryConsole,
                 say: Callable[[str], None]) -> None:
        self.plan = plan
        self.gateway = gateway
        self.console = console
        self.say = say
        self.alpha = A.planned_alpha(plan)

    def analyse(self, state: RolloutState) -> Analysis:
        """Judge ``state``'s phase on what happened since it began (it records the noise floor and the probe
        scores it measures in ``state``; the caller appends the analysis)."""
        spec = state.spec
        now = time.time()
        window = self.gateway.window(state.phase_started_at, now, disagreements=10)
        champ = ("champion", spec.champion_version)
        look = len(state.analyses) + 1
        if state.phase == BASELINE:
            return self._judge_floor(state, window, look, now)
        verdicts = []
        step = self.plan.steps[state.step_index] if state.phase == CANARY else None
        if state.phase == SHADOW:
            verdicts += A.systems_verdicts(window, ("shadow", spec.candidate_version), champ, self.plan.gates,
                                           self.alpha, self.plan.shadow_min_pairs, streamed=False)
            verdicts.append(A.agreement_verdict(window, spec.champion_version, spec.candidate_version,
                                                state.floor, self.plan.gates, self.alpha,
                                                self.plan.shadow_min_pairs))
        else:
            since = _canary_since(state)
            rates = window if since >= state.phase_started_at else self.gateway.window(since, now,
                                                                                       disagreements=0)
            keys = A.keys_verdict(window, ("canary", spec.candidate_version), _reference(state), step.min_keys)
            verdicts += A.unjudged_without_keys(
                A.systems_verdicts(window, ("canary", spec.candidate_version), _reference(state), self.plan.gates,
                                   self.alpha, step.min_requests, streamed=True, rates_window=rates), keys)
            verdicts.append(keys)
        if not _behaviour_settled(state):
            verdicts += self._behaviour_verdicts(state)
        candidate_variant = ("shadow" if state.phase == SHADOW else "canary", spec.candidate_version)
        compared_with = champ if state.phase == SHADOW else _reference(state)
        compared = ("shadow", "champion") if state.phase == SHADOW else ("canary", compared_with[0])
        minimum = self.plan.shadow_min_pairs if state.phase == SHADOW else step.min_requests
        return Analysis(look, state.phase, state.weight, state.phase_started_at, now, verdicts,
                        A.metrics_of(verdicts, window, candidate_variant, compared_with, state.weight),
                        window.get("disagreements", []) if state.phase == SHADOW else [],
                        A.traffic_rows(window),
                        A.traffic_advice(window, compared, state.weight, now - state.phase_started_at, minimum,
                                         step.min_keys if step else 0),
                        sorted(state.waivers))

    def _judge_floor(self, state: RolloutState, window: dict[str, Any], look: int, now: float) -> Analysis:
        spec = state.spec
        counts = A.pair_counts(window, spec.champion_version, spec.champion_version)
        enough = counts["compared"] >= self.plan.baseline_min_pairs
        agreement = counts["agree"] / counts["compared"] if counts["compared"] else None
        where = " on the baseline replica" if spec.baseline_replicas else ""  # an adapter's: on the same replicas
        verdict = Verdict("noise_floor", PASS if enough else INCONCLUSIVE, agreement, None, "measured", None,
                          counts["compared"], self.plan.baseline_min_pairs,
                          f"champion agrees with its own snapshot{where} on {counts['agree']}/{counts['compared']} "
                          f"mirrored requests" if counts["compared"] else "no mirrored requests yet")
        if enough:
            state.floor = counts
        return Analysis(look, BASELINE, 0.0, state.phase_started_at, now, [verdict],
                        {"noise_floor.agreement": agreement or 0.0, "noise_floor.pairs": counts["compared"]},
                        window.get("disagreements", []))

    def _behaviour_verdicts(self, state: RolloutState) -> list:
        spec = state.spec
        verdicts = []
        items = load_probes(self.plan.probes)
        if items:
            candidate_variant = "shadow" if state.phase == SHADOW else "canary"
            self.say(f"probing champion and candidate with {len(items)} verifiable prompts")
            salt = f"{state.id}/{len(state.analyses)}"  # the sampled probes' seeds: both sides alike, fresh per look
            champion = run_probes(self.gateway, "champion", items, self.plan.probes, salt).to_json()
            if state.phase == CANARY and spec.has_baseline:
                # in a canary step the same probes go to the baseline at the same time, so the load they add
                # falls on both replicas the latency gates compare, not on the candidate's alone
                with ThreadPoolExecutor(2) as pool:
                    mirrored = pool.submit(run_probes, self.gateway, "baseline", items, self.plan.probes, salt)
                    candidate = run_probes(self.gateway, candidate_variant, items, self.plan.probes, salt).to_json()
                    mirrored.result()
            else:
                candidate = run_probes(self.gateway, candidate_variant, items, self.plan.probes, salt).to_json()
            scores = {"champion": champion, "candidate": candidate}
            if state.probes:  # an earlier look's probes, not yet passed: its sampled draws count here too
                scores = {side: pool_sampled(state.probes[side], score) for side, score in scores.items()}
            state.probes = scores
            verdicts += A.probe_verdicts(scores, self.plan.gates, self.alpha)
        record = self.console.eval_record(spec.candidate_version)
        passed = spec.eval_passed if spec.eval_passed is not None else None if record is None else record["passed"]
        verdict = A.eval_record_verdict(passed, self.plan.gates)
        if verdict is not None:
            verdicts.append(verdict)
        verdicts += offline_verdicts(record, self.console.eval_record(spec.champion_version), self.plan.gates,
                                       self.alpha)
        return verdicts


def _reference(state: RolloutState) -> tuple[str, str]:
    """What a canary step is judged against: the baseline replica, or the champion pool without one."""
    spec = state.spec
    return ("baseline" if spec.has_baseline else "champion", spec.champion_version)


def _canary_since(state: RolloutState) -> float:
    """When this rollout's canary phase began (its first step): the rate gates count from there."""
    starts = [d["at"] for d in state.decisions if d["kind"] == "phase" and d["to"].startswith("canary")]
    return min(starts, default=state.phase_started_at)


def _behaviour_settled(state: RolloutState) -> bool:
    """Whether the probes and the offline record have passed at some look of this rollout.

    They are judged at every look until they pass, then not again (the same probes and the same snapshots: a
    passed set would pass again but for sampling noise, and a second chance to fail on noise is a false alarm
    the alpha budget did not plan for). Judging them once per rollout would let a verdict that
    was inconclusive at the first look vanish from the next one: a silent pass.
    """
    waived = state.waivers
    for analysis in state.analyses:
        behaviour = [v for v in analysis["verdicts"] if A.is_behaviour_gate(v["gate"])]
        if behaviour and all(v["outcome"] == PASS or (v["gate"] in waived and v["outcome"] != FAIL)
                             for v in behaviour):
            return True
    return False
