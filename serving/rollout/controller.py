"""The rollout controller: a persisted state machine that moves a candidate from shadow to champion.

    baseline ──► shadow ──► canary 5% ──► 25% ──► 50% ──► [awaiting approval] ──► promoted (──► bake)
        any failed critical gate, a dead candidate, or a person ──────────────────► rolled_back
        inconclusive after its extensions, an advisory gate failed, or a person ──► paused

Each ``tick`` first finishes a transition a previous process left half-done, then reads what a person
asked for in the MLflow UI (the ``champion`` alias, the ``rollout.action`` tag), then checks the
candidate's replicas, and when the phase's window has run its time, judges it (``phase_judge.py``). Every
change is a ``Transition`` written down before it is applied (see ``state.py``), so kill -9 at any instant
loses nothing and repeats nothing. What MLflow shows of it all is written by ``recording.py``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from serving.fleet.gateway_client import read_secret
from serving.fleet.gateway_group import GatewayGroup
from serving.rollout import analysis as A
from serving.rollout import recording, report
from serving.rollout.analysis import Analysis
from serving.rollout.crash import crash_point
from serving.rollout.evidence import next_for_evidence
from serving.rollout.judge import FAIL, INCONCLUSIVE, PASS
from serving.rollout.phase_judge import PhaseJudge
from serving.rollout.registry_console import ACTIONS, RegistryConsole
from serving.rollout.resumable import write_plan
from serving.rollout.state import (
    AWAITING_APPROVAL,
    BAKE,
    BASELINE,
    CANARY,
    PAUSED,
    PROMOTED,
    ROLLED_BACK,
    SHADOW,
    RolloutError,
    RolloutSpec,
    RolloutState,
    StateFile,
    Transition,
    new_rollout_id,
)
from serving.rollout.tracking import RolloutRun
from serving.rollout.transitions import plan_transition
from serving.rollout.waivers import split_known, waive_hint, waived_tag

log = logging.getLogger("serving.rollout")
CONTROLLER = "rollout controller"
UNHEALTHY_GRACE_S = 2.0  # a candidate with no healthy replica this long fails its phase


class Controller:
    def __init__(self, directory: str | Path, say: Callable[[str], None] | None = None) -> None:
        self.files = StateFile(directory)
        if not self.files.exists():
            raise RolloutError(f"{self.files.path}: no rollout here")
        self.state = self.files.load()
        spec = self.state.spec
        self.plan = spec.plan
        self.console = RegistryConsole(spec.model_name, spec.tracking_uri)
        self.gateway = GatewayGroup(spec.gateways, read_secret(spec.admin_key_file), lane=spec.lane)
        self.run = RolloutRun(spec.tracking_uri, self.state.mlflow_run_id)
        self.say = say or (lambda line: log.info("%s", line))
        self.judge = PhaseJudge(self.plan, self.gateway, self.console, self.say)

    # ----------------------------------------------------------------- creation
    @classmethod
    def create(cls, directory: str | Path, spec: RolloutSpec, say: Callable[[str], None] | None = None
               ) -> Controller:
        """Write the initial state, open the MLflow run and enter the first phase."""
        files = StateFile(directory)
        if files.exists() and not files.load().terminal:
            raise RolloutError(f"{files.path}: a rollout is already in progress here")
        if spec.start not in (SHADOW, CANARY):
            raise RolloutError(f"start: must be 'shadow' or 'canary', got {spec.start!r}")
        state = RolloutState(id=new_rollout_id(spec.candidate_version), spec=spec, phase="starting")
        files.dir.mkdir(parents=True, exist_ok=True)
        files.save(state)
        write_plan(files.dir, spec.plan)  # how to roll the version out afresh, should this fleet go away
        controller = cls(directory, say)
        controller._begin()
        return controller

    def _begin(self) -> None:
        spec = self.state.spec
        self.state.mlflow_run_id = recording.start_run(self.run, self.state)
        self._save()
        self.console.set_tags(spec.candidate_version, {"rollout.run": self.state.mlflow_run_id,
                                                       "rollout.verdict": "–"})
        if spec.start == SHADOW and self.plan.baseline_seconds > 0:
            self._enter(BASELINE, "rollout started: measuring the noise floor (champion mirrored to its own snapshot)")
        elif spec.start == SHADOW and self.plan.shadow_seconds > 0:
            self._enter(SHADOW, "rollout started")
        else:
            self._enter(CANARY, "rollout started at the first canary step", step_index=0)

    # ----------------------------------------------------------------- the loop
    def run_until_done(self, max_seconds: float | None = None, *, stop_when_waiting: bool = False) -> RolloutState:
        """Tick until promoted or rolled back. A paused rollout keeps polling for a person's decision,
        unless ``stop_when_waiting`` (then a pause or an approval wait returns too)."""
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        while not self.state.terminal:
            self.tick()
            if self.state.terminal or (deadline is not None and time.monotonic() > deadline):
                break
            if stop_when_waiting and self.state.phase in (PAUSED, AWAITING_APPROVAL):
                break
            time.sleep(self.plan.tick_seconds)
        return self.state

    def tick(self) -> None:
        if self.state.pending is not None:
            self._apply(self.state.pending)
        if self.state.terminal:
            return
        if self._manual_actions():
            return
        phase = self.state.phase
        if phase in (PAUSED, AWAITING_APPROVAL):
            return
        if phase == BAKE:
            if time.time() - self.state.phase_started_at >= self.plan.bake_seconds:
                self._enter(PROMOTED, "bake time over without a rollback", final_status="FINISHED")
            return
        if self._candidate_unavailable():
            return
        if time.time() >= self._deadline():
            self._analyse()

    def _deadline(self) -> float:
        seconds = self._phase_seconds()
        return self.state.phase_started_at + seconds * (1 + self.state.extensions) + self.state.evidence_extra_seconds

    # ----------------------------------------------------------------- a person's hand
    def _manual_actions(self) -> bool:
        spec = self.state.spec
        champion = self.console.alias_version("champion")
        if self.state.phase == BAKE:
            if champion != spec.candidate_version:
                self._rollback(f"champion alias moved by hand to v{champion} during the bake", "a person (MLflow UI)")
                return True
        elif champion == spec.candidate_version:
            self._promote("champion alias moved to the candidate by hand", "a person (MLflow UI)")
            return True
        elif champion != spec.champion_version:
            self._rollback(f"champion alias moved by hand to v{champion}", "a person (MLflow UI)")
            return True
        if self._waivers():
            return True
        request = self.console.read_action(spec.candidate_version)
        if request is None:
            return False
        action, actor = request
        self.console.clear_action(spec.candidate_version)
        if action not in ACTIONS:
            self._record("action", self.state.phase, self.state.phase, f"ignored unknown action {action!r}", actor)
            return False
        if action == "promote":
            self._promote("promotion asked for (rollout.action = promote)", actor)
        elif action == "rollback":
            self._rollback("rollback asked for (rollout.action = rollback)", actor)
        elif action == "pause" and self.state.phase not in (PAUSED, BAKE):
            self._pause("paused by hand (rollout.action = pause)", actor)
        elif action == "resume" and self.state.phase in (PAUSED, AWAITING_APPROVAL):
            self._resume(actor)
        else:
            self._record("action", self.state.phase, self.state.phase,
                         f"{action} has no effect in phase {self.state.phase}", actor)
            return False
        return True

    def _waivers(self) -> bool:
        """A person waived gates (``rollout.waive`` tag, or ``deploy resume --waive``): record who and when,
        tag the version, and go on from a pause or an approval wait. True when the phase changed."""
        from serving.rollout.registry_console import ACTOR_TAG, WAIVE_TAG, WAIVED_TAG

        spec, state = self.state.spec, self.state
        request = self.console.read_waive(spec.candidate_version)
        if request is None:
            return False
        gates, actor = request
        self.console.clear_action(spec.candidate_version, keys=(WAIVE_TAG, ACTOR_TAG))
        gates, unknown, known = split_known(gates, self.plan, state.analyses)
        if unknown:
            self._record("waive", state.phase, state.phase, f"ignored unknown gate(s) {', '.join(unknown)} "
                         f"(gates: {', '.join(sorted(known))})", actor)
        if not gates:
            self._save()
            return False
        now = time.time()
        for gate in gates:
            state.waivers[gate] = {"actor": actor, "at": now, "phase": self._label(state.phase, state.step_index)}
        self._record("waive", state.phase, state.phase, f"waived {', '.join(gates)}: still measured and shown, no "
                     "longer holding the rollout (a failed critical gate still rolls back)", actor,
                     detail=",".join(gates))
        self._save()
        self.console.set_tags(spec.candidate_version, {WAIVED_TAG: waived_tag(state.waivers)})
        if state.phase in (PAUSED, AWAITING_APPROVAL):
            self._resume(actor)
            return True
        return False

    def _candidate_unavailable(self) -> bool:
        """Fail fast when the candidate's replicas are all down (users are already on the champion)."""
        variant = {SHADOW: "shadow", CANARY: "canary"}.get(self.state.phase)
        if variant is None:
            return False
        healthy, last_error = self.gateway.healthy_replicas(variant)
        if healthy:
            if self.state.unhealthy_since is not None:
                self.state.unhealthy_since = None
                self._save()
            return False
        now = time.time()
        if self.state.unhealthy_since is None:
            self.state.unhealthy_since = now
            self._save()
            return False
        if now - self.state.unhealthy_since < UNHEALTHY_GRACE_S:
            return False
        self._rollback(f"candidate replicas unavailable ({last_error or 'no healthy replica'})", CONTROLLER)
        return True

    # ----------------------------------------------------------------- judging a phase
    def _analyse(self) -> None:
        result = self.judge.analyse(self.state)
        self.state.analyses.append(result.to_json())
        self._save()
        recording.record_analysis(self.console, self.run, self.state, result, self.say)
        self._decide(result)

    def _decide(self, result: Analysis) -> None:
        state, outcome = self.state, result.outcome
        if outcome == FAIL:
            self._rollback(f"gate failed at analysis {result.look}: {result.reasons}", CONTROLLER)
            return
        if outcome == "review":
            self._pause(f"advisory gate failed, a person should read the disagreements: {result.reasons}"
                        f"{waive_hint(result.failed())}", CONTROLLER)
            return
        if outcome == INCONCLUSIVE and self._collect_evidence(result):
            return
        if outcome == INCONCLUSIVE:
            # a fact no window can settle (no eval record) waits for a person anyway: pause now, not after extending
            facts = ", ".join(v.gate for v in result.inconclusive() if not A.more_time_helps(v))
            waiting_helps = not facts
            if waiting_helps and state.extensions < self.plan.max_extensions:
                state.extensions += 1
                self._record("extend", state.phase, state.phase, f"inconclusive, extending ({state.extensions}/"
                             f"{self.plan.max_extensions}): {result.reasons}", CONTROLLER)
                self._save()
                return
            why = (f"still inconclusive after {state.extensions} extension(s)" if waiting_helps
                   else f"inconclusive, and more traffic would not change it ({facts})")
            self._pause(f"{why}: {result.reasons}{waive_hint(result.inconclusive())}", CONTROLLER)
            return
        self._advance(f"analysis {result.look} passed ({result.summary})")

    def _collect_evidence(self, result: Analysis) -> bool:
        """Go on collecting when all that holds ``result`` back is a 5xx, 429 or latency gate short of requests
        (evidence.py decides how); True when it did."""
        state = self.state
        decision = next_for_evidence(state, self.plan, result, self._phase_seconds())
        if decision is None:
            return False
        if decision.extend_seconds is None:
            self._advance(decision.cause)
            return True
        state.evidence_extensions += 1
        state.evidence_extra_seconds += decision.extend_seconds
        self._record("extend", state.phase, state.phase, decision.cause, CONTROLLER)
        self._save()
        return True

    def _phase_seconds(self) -> float:
        seconds = {BASELINE: self.plan.baseline_seconds, SHADOW: self.plan.shadow_seconds}.get(self.state.phase)
        return self.plan.steps[self.state.step_index].seconds if seconds is None else seconds

    def _advance(self, cause: str, actor: str = CONTROLLER, from_phase: str | None = None) -> None:
        """The next phase after a passed analysis of ``from_phase`` (default: the current phase)."""
        state = self.state
        phase = from_phase or state.phase
        if phase == BASELINE:
            if self.plan.shadow_seconds > 0:
                self._enter(SHADOW, cause, actor)
            else:
                self._enter(CANARY, cause, actor, step_index=0)
            return
        if phase == SHADOW:
            self._enter(CANARY, cause, actor, step_index=0)
            return
        step = self.plan.steps[state.step_index]
        last = state.step_index == len(self.plan.steps) - 1
        if step.approval == "required" or (last and self.plan.promotion_approval == "required"):
            self._enter(AWAITING_APPROVAL, f"{cause}; waiting for a person to approve", actor, resume_to=CANARY,
                        step_index=state.step_index)
            return
        if last:
            self._promote(cause, actor)
        else:
            self._enter(CANARY, cause, actor, step_index=state.step_index + 1)

    def _resume(self, actor: str) -> None:
        state = self.state
        if state.phase == AWAITING_APPROVAL:  # approval to go on: the next step, or promotion after the last
            if state.step_index >= len(self.plan.steps) - 1:
                self._promote("approved (rollout.action = resume)", actor)
            else:
                self._enter(CANARY, "approved to continue (rollout.action = resume)", actor=actor,
                            step_index=state.step_index + 1)
            return
        target = state.resume_to or CANARY
        last = Analysis.from_json(state.analyses[-1]) if state.analyses else None
        if last is not None and last.phase == target and state.waivers:
            last.waived = sorted(state.waivers)
            if last.outcome == PASS:  # the pause was over gates a person has now waived: go on from here
                self._advance(f"analysis {last.look} passes with {', '.join(last.waived)} waived", actor,
                              from_phase=target)
                return
        self._enter(target, "resumed by hand: the phase is judged again on a new window", actor=actor,
                    step_index=state.step_index)

    # ----------------------------------------------------------------- transitions
    def _pause(self, cause: str, actor: str) -> None:
        resume_to = self.state.resume_to if self.state.phase == AWAITING_APPROVAL else self.state.phase
        self._enter(PAUSED, cause, actor=actor, resume_to=resume_to, step_index=self.state.step_index)

    def _promote(self, cause: str, actor: str) -> None:
        to = BAKE if self.plan.bake_seconds > 0 else PROMOTED
        self._enter(to, cause, actor=actor, step_index=self.state.step_index,
                    final_status="FINISHED" if to == PROMOTED else None)

    def _rollback(self, cause: str, actor: str) -> None:
        self._enter(ROLLED_BACK, cause, actor=actor, step_index=self.state.step_index, final_status="FAILED")

    def _enter(self, phase: str, cause: str, actor: str = CONTROLLER, *, step_index: int | None = None,
               resume_to: str | None = None, final_status: str | None = None) -> None:
        step_index = self.state.step_index if step_index is None else step_index
        routing, aliases = plan_transition(self.state, self.plan, phase, step_index)
        transition = Transition(id=uuid.uuid4().hex[:8], to_phase=phase, cause=cause, actor=actor, at=time.time(),
                                routing=routing, aliases=aliases, step_index=step_index)
        self.state.pending = transition
        self.state.resume_to = resume_to
        self._save()
        self._apply(transition)
        if final_status is not None and self.state.phase == phase:
            self.run.set_tags({"rollout.status": phase})
            self.run.finish(final_status)

    def _apply(self, t: Transition) -> None:
        """Finish ``t``: routing, then each alias (checked against the registry first), then the record."""
        state = self.state
        if not t.routing_done:
            if t.routing:
                self.gateway.set_routing(dict(t.routing), actor=f"{CONTROLLER} ({state.id})")
            t.routing_done = True
            self._save()
        for move in t.aliases:
            if move.done:
                continue
            current = self.console.alias_version(move.alias)
            move.previous = current
            if current != move.version:
                self.console.set_alias(move.alias, move.version)
                crash_point(f"after-alias:{move.alias}")
                move.moved = True
            elif state.aliases_set.get(move.alias, "unset") == move.version:
                move.ours = True  # still where this rollout put it: nothing happened
            state.aliases_set[move.alias] = move.version
            move.done = True
            self._save()
        if not t.recorded:
            from_phase = state.phase
            from_label = self._label(state.phase, state.step_index)
            state.phase, state.step_index, state.phase_started_at = t.to_phase, t.step_index, t.at
            if t.to_phase not in (PAUSED, AWAITING_APPROVAL):
                state.extensions = 0
                state.evidence_extensions, state.evidence_extra_seconds = 0, 0.0
            state.reason = t.cause if t.to_phase in (PAUSED, ROLLED_BACK, AWAITING_APPROVAL) else ""
            if t.to_phase in (PROMOTED, ROLLED_BACK):
                state.finished_at = t.at
            self._record("phase", from_label, self._label(t.to_phase, t.step_index), t.cause, t.actor, at=t.at)
            for move in t.aliases:
                if move.moved or move.previous != move.version:
                    target = f"v{move.version}" if move.version else "(removed)"
                    was = f"v{move.previous}" if move.previous else "unset"
                    self._record("alias", from_phase, t.to_phase, t.cause, t.actor, at=t.at,
                                 detail=f"{move.alias}: {was} → {target}")
                elif move.version is not None and not move.ours:
                    self._record("alias", from_phase, t.to_phase, t.cause, t.actor, at=t.at,
                                 detail=f"{move.alias}: already v{move.version} (in place before this transition)")
            t.recorded = True
            self._save()
        state.pending = None
        self._save()
        recording.tag_versions(self.console, self.run, self.state)
        recording.write_artifacts(self.run, self.state)

    def _label(self, phase: str, step_index: int) -> str:
        if phase in (CANARY, AWAITING_APPROVAL) and 0 <= step_index < len(self.plan.steps):
            return f"{phase} {self.plan.steps[step_index].weight:g}%"
        return phase

    def _record(self, kind: str, from_phase: str, to: str, cause: str, actor: str, *, at: float | None = None,
                detail: str = "") -> None:
        entry = {"at": at or time.time(), "kind": kind, "from": from_phase, "to": to, "cause": cause,
                 "actor": actor, "detail": detail, "weight": self.state.weight}
        self.state.decisions.append(entry)
        line = report.timeline_lines(self.state)[-1]
        self.say(line)

    def _save(self) -> None:
        self.files.save(self.state)

    def close(self) -> None:
        self.gateway.close()
