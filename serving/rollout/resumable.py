"""Can a persisted rollout go on? Its controller drives the gateway and replicas its spec names; when that fleet
is gone, ticking would only find nobody to route to. The pipeline's rollout stage rehearses on a fleet of its own,
with replayed traffic, and stops it when the stage ends, a pause included (no traffic would come after it), and
`deploy stop` stops a fleet under a paused rollout. Such a rollout cannot be resumed; what the user can do is roll
the same version out afresh, under the same plan, on the fleet that serves users: this module writes that plan
beside the rollout's state and says the one command.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict
from pathlib import Path

import yaml

from artifacts.common.atomic import atomic_write_text
from artifacts.common.net import answers_200
from serving.rollout.plan import RolloutPlan
from serving.rollout.state import RolloutState

PLAN_FILE = "plan.yaml"  # the rollout's plan, as `deploy snapshot --plan` reads it


def write_plan(directory: str | Path, plan: RolloutPlan) -> Path:
    """``plan.yaml`` in the rollout's directory: the plan it runs under, readable by ``deploy snapshot --plan``."""
    return atomic_write_text(Path(directory) / PLAN_FILE, yaml.safe_dump(asdict(plan), sort_keys=False))


def restart_command(directory: str | Path, state: RolloutState) -> str:
    """The `deploy` command that starts this version's rollout afresh on the deploy fleet, under this plan."""
    spec = state.spec
    words = ["deploy", "snapshot", f"models:/{spec.model_name}/{spec.candidate_version}"]
    plan_file = Path(directory) / PLAN_FILE
    if plan_file.is_file():
        words += ["--plan", str(plan_file)]
    elif spec.plan.probes.data_dir:
        words += ["--probes", spec.plan.probes.data_dir]
    return shlex.join([*words, "--wait"])


def why_not_resumable(directory: str | Path, state: RolloutState) -> str | None:
    """None when the rollout can be driven on (it has ended, or a gateway of its fleet answers); else one line
    for the user: the fleet is gone, and the command that rolls the version out afresh."""
    if state.terminal or any(answers_200(url + "/health") for url in state.spec.gateways):
        return None
    return (f"rollout {state.id} ({state.phase}) cannot go on: its fleet is not running (no gateway answers at "
            f"{', '.join(state.spec.gateways)}); roll v{state.spec.candidate_version} out afresh, under the same "
            f"plan: {restart_command(directory, state)}")
