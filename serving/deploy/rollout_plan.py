"""The plan a rollout started by `deploy snapshot` runs: ``--plan`` (a RolloutPlan YAML), ``--probes`` (the
held-out prompts that probe both models) and ``--waive`` (gates requested as waived, recorded with the person's
name). A snapshot's rollout and an adapter's take the same options."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from serving.cli import ServeError
from serving.deploy.control import actor
from serving.deploy.release_gates import waived_gates


def rollout_plan(args: argparse.Namespace, console, version: str):
    """The plan a rollout started by this command runs (``--plan``, ``--probes``), with the gates ``--waive``
    names requested as waived on ``version`` (the controller records who and when, as for `deploy resume`)."""
    from serving.rollout.analysis import known_gates

    plan = load_plan(args.plan)
    if args.probes:
        plan.probes = replace(plan.probes, data_dir=str(Path(args.probes).resolve()))
    waive = waived_gates(args.waive)
    unknown = [g for g in waive if g not in known_gates(plan)]
    if unknown:
        raise ServeError(f"--waive: no gate named {unknown[0]!r} (gates: {', '.join(sorted(known_gates(plan)))})")
    if waive:
        console.request_waive(version, waive, actor())
    return plan


def load_plan(path: str | None):
    """The RolloutPlan of a YAML file (its fields, validated as a recipe section is); the default plan without one."""
    from serving.rollout.plan import RolloutPlan

    if not path:
        return RolloutPlan()
    from artifacts.common.config_loader import build_dataclass, read_yaml_mapping

    return build_dataclass(RolloutPlan, read_yaml_mapping(Path(path)), key="", source=path)
