"""Where each phase puts traffic and the registry's aliases: the routing patch and alias moves a
``Transition`` carries. A pure function of the rollout's state, so the controller can write a transition
down before applying it, and a restarted controller re-applies the very same patch. An adapter's rollout has
the same patches for its lane (the gateway client leaves out the replica lists, which a lane does not have)."""

from __future__ import annotations

from typing import Any

from serving.rollout.plan import RolloutPlan
from serving.rollout.state import (
    AWAITING_APPROVAL,
    BAKE,
    BASELINE,
    CANARY,
    PAUSED,
    PROMOTED,
    ROLLED_BACK,
    SHADOW,
    AliasMove,
    RolloutError,
    RolloutState,
)

NO_VARIANT = {"replicas": [], "version": "", "served_model": ""}


def plan_transition(state: RolloutState, plan: RolloutPlan, phase: str, step_index: int
                    ) -> tuple[dict[str, Any], list[AliasMove]]:
    """The routing patch and alias moves that put the fleet in ``phase`` (both idempotent)."""
    spec = state.spec
    cand = {"replicas": spec.candidate_replicas, "version": spec.candidate_version,
            "served_model": spec.candidate_served_model}
    champ = {"replicas": spec.champion_replicas, "version": spec.champion_version,
             "served_model": spec.champion_served_model}
    none = NO_VARIANT
    base = {"replicas": spec.baseline_replicas, "version": spec.champion_version,
            "served_model": spec.champion_served_model} if spec.has_baseline else none
    salt = state.id
    # every active phase restates the champion, so the gateway labels its traffic with the right version
    if phase == BASELINE:  # the noise floor: the champion against its own snapshot on another replica, the
        # baseline's when there is one (two replicas, as the shadow phase compares), else its own replicas (an
        # adapter's: the champion adapter against itself, in the same replicas)
        floor = base if spec.has_baseline else champ
        return ({"champion": champ, "shadow": floor, "shadow_fraction": plan.shadow_fraction,
                 "canary": none, "baseline": none, "canary_weight": 0.0, "split_salt": salt}, [])
    if phase == SHADOW:
        return ({"champion": champ, "shadow": cand, "shadow_fraction": plan.shadow_fraction,
                 "canary": none, "baseline": none, "canary_weight": 0.0, "split_salt": salt},
                [AliasMove("shadow", spec.candidate_version)])
    if phase == CANARY:
        weight = plan.steps[step_index].weight
        return ({"champion": champ, "canary": cand, "baseline": base, "canary_weight": weight, "shadow": none,
                 "shadow_fraction": 0.0, "split_salt": salt},
                [AliasMove("canary", spec.candidate_version), AliasMove("shadow", None)])
    if phase in (PAUSED, AWAITING_APPROVAL):
        return {}, []  # hold traffic where it is
    if phase in (BAKE, PROMOTED):
        if state.phase == BAKE:  # bake over: the previous champion's replicas retire
            return {}, []
        return ({"champion": cand, "canary": none, "baseline": none, "canary_weight": 0.0, "shadow": none,
                 "shadow_fraction": 0.0},
                [AliasMove("previous-champion", spec.champion_version),
                 AliasMove("champion", spec.candidate_version), AliasMove("canary", None),
                 AliasMove("shadow", None)])
    if phase == ROLLED_BACK:
        return ({"champion": champ, "canary": none, "baseline": none, "canary_weight": 0.0, "shadow": none,
                 "shadow_fraction": 0.0},
                [AliasMove("champion", spec.champion_version), AliasMove("canary", None),
                 AliasMove("shadow", None)])
    raise RolloutError(f"no such phase {phase!r}")
