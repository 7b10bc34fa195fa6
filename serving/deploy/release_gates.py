"""Did a snapshot pass its release gates? Asked by `deploy snapshot` before it installs a version as champion
with no rollout (the first champion of a model, or ``--as champion``).

A rollout judges the eval record as one of its gates (``eval_record``), but an install has no canary to judge:
without this check a version whose release failed its safety gate became the first champion after a smoke
check, without a word. An install of a failed release is refused in one line that names the failed gates,
unless the person passes ``--waive eval_record``; the waiver is recorded on the version (``rollout.waived``,
as a rollout records one) and in the install's cause.

The verdict is the registry's (the ``lifecycle.gates_passed`` tag the release stage sets, which rollouts read
too), else the bundle's own ``eval_record.json``; a snapshot with neither is installed with a warning line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from serving.cli import ServeError

if TYPE_CHECKING:
    from serving.rollout.registry_console import RegistryConsole

EVAL_RECORD_GATE = "eval_record"


@dataclass(frozen=True)
class ReleaseVerdict:
    passed: bool | None  # None: no record anywhere
    failed: list[str] = field(default_factory=list)  # the failed gates, as the record words them
    source: str = ""


def release_verdict(console: RegistryConsole, version: str, bundle: Path) -> ReleaseVerdict:
    registered = console.eval_record(version)
    if registered is None:
        return _bundle_record(bundle)
    if registered["passed"]:
        return ReleaseVerdict(True, [], "the registry")
    # the gates by name: from the record logged beside the version's run, else the bundle's, else the tag's count
    failed = _failed(registered.get("gates") or {}) or _bundle_record(bundle).failed or [registered["summary"]]
    return ReleaseVerdict(False, failed, "the registry's lifecycle.gates_passed tag")


def _bundle_record(bundle: Path) -> ReleaseVerdict:
    from artifacts.errors import EvalRecordError
    from artifacts.eval_record import read_eval_record

    try:
        record = read_eval_record(bundle)
    except EvalRecordError:
        return ReleaseVerdict(None)
    if record.passed is None:
        return ReleaseVerdict(None)
    failed = _failed(record.gates)
    return ReleaseVerdict(record.passed, [] if record.passed else failed or ["the record says failed"],
                          f"{bundle.name}/eval_record.json")


def _failed(gates: dict) -> list[str]:
    """The failed gates of an eval record's ``gates`` (gate -> {"passed", "reason", ...}), with their reasons."""
    return [f"{gate} ({outcome.get('reason') or 'failed'})" if isinstance(outcome, dict) else str(gate)
            for gate, outcome in gates.items()
            if not (outcome.get("passed", True) if isinstance(outcome, dict) else outcome)]


def check_install(verdict: ReleaseVerdict, version: str, waive: list[str], console: RegistryConsole,
                  actor: str) -> str:
    """Refuse to install a failed release unless ``eval_record`` is waived (then record who waived it); returns
    what the install's cause should add ("" when nothing was waived)."""
    other = [g for g in waive if g != EVAL_RECORD_GATE]
    if other:
        raise ServeError(f"--waive: an install has no canary to judge, so only {EVAL_RECORD_GATE} applies "
                         f"(got {', '.join(other)})")
    if verdict.passed is None:
        print(f"warning: v{version} has no eval record (no release gates were checked); installing it",
              flush=True)
        return ""
    if verdict.passed:
        return ""
    gates = "; ".join(verdict.failed)
    if EVAL_RECORD_GATE not in waive:
        raise ServeError(f"v{version} failed its release gates ({gates}; from {verdict.source}): not installed. "
                         f"To install it anyway, add --waive {EVAL_RECORD_GATE} (recorded on the version with "
                         "your name)")
    from serving.rollout.registry_console import WAIVED_TAG

    when = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    console.set_tags(version, {WAIVED_TAG: f"{EVAL_RECORD_GATE} by {actor} at {when}"})
    print(f"v{version} failed its release gates ({gates}); installing it anyway: {EVAL_RECORD_GATE} waived by "
          f"{actor}", flush=True)
    return f"; failed release gates waived by {actor}"


def waived_gates(text: str | None) -> list[str]:
    return [g.strip() for g in (text or "").split(",") if g.strip()]
