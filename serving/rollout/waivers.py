"""Gates a person waived: which names count, how the version tag shows them, and the hint a pause prints.

A waived gate is still measured and shown; it only stops holding the rollout (a failed critical gate still
rolls back). The controller applies waivers; this module keeps their wording and bookkeeping in one place."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from serving.rollout.analysis import known_gates
from serving.rollout.judge import FAIL, Verdict
from serving.rollout.plan import RolloutPlan


def split_known(gates: Iterable[str], plan: RolloutPlan, analyses: Sequence[dict[str, Any]]
                ) -> tuple[list[str], list[str], set[str]]:
    """(the gates that exist, the names that do not, every gate name): a gate exists when the plan declares
    it or an analysis of this rollout judged it."""
    known = known_gates(plan) | {v["gate"] for a in analyses for v in a["verdicts"]}
    gates = list(gates)
    return [g for g in gates if g in known], [g for g in gates if g not in known], known


def waived_tag(waivers: dict[str, dict[str, Any]]) -> str:
    """The version tag's text: who waived which gate, and when."""
    return "; ".join(f"{gate} by {w['actor']} at {time.strftime('%Y-%m-%d %H:%M', time.localtime(w['at']))}"
                     for gate, w in waivers.items())


def waive_hint(verdicts: Sequence[Verdict]) -> str:
    """How to go on past the gates that held a rollout (none for a failed critical gate: that rolls back)."""
    gates = ",".join(v.gate for v in verdicts if not (v.outcome == FAIL and v.critical))
    if not gates:
        return ""
    return (f" — to go on without them: `deploy resume --waive {gates}`, or the version tag "
            f"rollout.waive = {gates}")
