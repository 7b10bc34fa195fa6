"""The MLflow model registry as the record and the console of a rollout.

Aliases say what serves (``champion``, ``canary``, ``shadow``, ``previous-champion``); short version tags
say where each version stands (``rollout.state``, ``rollout.verdict``, ``rollout.vs_champion``). A person
steers from the MLflow UI in the two ways it allows: moving the ``champion`` alias, or setting the tag
``rollout.action`` (promote | rollback | pause | resume) on the candidate version; the controller polls
both. MLflow keeps no alias history, so every move is also written to the rollout's own audit trail.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from artifacts.errors import RegistryError

ACTION_TAG = "rollout.action"
ACTOR_TAG = "rollout.actor"
WAIVE_TAG = "rollout.waive"  # comma-separated gate names a person waives (and so resumes a pause)
WAIVED_TAG = "rollout.waived"  # what the controller shows back: the gates waived, by whom
ACTIONS = ("promote", "rollback", "pause", "resume")
ALIASES = ("champion", "canary", "shadow", "previous-champion")
log = logging.getLogger("serving.rollout")


class RegistryConsole:
    def __init__(self, model_name: str, tracking_uri: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow import MlflowClient

        self.model_name = model_name
        self.client = MlflowClient(tracking_uri=tracking_uri or None)

    def _call(self, what: str, fn, *args):
        from mlflow.exceptions import MlflowException

        try:
            return fn(*args)
        except MlflowException as exc:
            raise RegistryError(f"{self.model_name}: {what} failed ({exc.message})") from exc

    # ----------------------------------------------------------------- aliases
    def alias_version(self, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(self.model_name, alias).version)
        except MlflowException:
            return None

    def set_alias(self, alias: str, version: str | None) -> None:
        if version is None:
            self._call(f"deleting alias {alias}", self.client.delete_registered_model_alias, self.model_name, alias)
        else:
            self._call(f"moving alias {alias}", self.client.set_registered_model_alias, self.model_name, alias,
                       str(version))

    # ----------------------------------------------------------------- version tags
    def tags(self, version: str) -> dict[str, str]:
        mv = self._call(f"reading version {version}", self.client.get_model_version, self.model_name, str(version))
        return dict(mv.tags or {})

    def set_tags(self, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._call(f"tagging version {version}", self.client.set_model_version_tag, self.model_name,
                       str(version), key, str(value)[:250])

    def read_action(self, version: str) -> tuple[str, str] | None:
        """A person's request on the version (``rollout.action``), with who asked when the CLI says so."""
        tags = self.tags(version)
        action = (tags.get(ACTION_TAG) or "").strip().lower()
        if not action:
            return None
        return action, tags.get(ACTOR_TAG) or "a person (MLflow UI tag)"

    def read_waive(self, version: str) -> tuple[list[str], str] | None:
        """The gates a person asked to waive on the version (``rollout.waive = gate[,gate]``), and who."""
        tags = self.tags(version)
        gates = [g.strip() for g in (tags.get(WAIVE_TAG) or "").split(",") if g.strip()]
        if not gates:
            return None
        return gates, tags.get(ACTOR_TAG) or "a person (MLflow UI tag)"

    def clear_action(self, version: str, keys: tuple[str, ...] = (ACTION_TAG, ACTOR_TAG)) -> None:
        from mlflow.exceptions import MlflowException

        for key in keys:
            try:
                self.client.delete_model_version_tag(self.model_name, str(version), key)
            except MlflowException:
                pass

    def request_waive(self, version: str, gates: list[str], actor: str) -> None:
        self.set_tags(version, {ACTOR_TAG: actor, WAIVE_TAG: ",".join(gates)})

    def request_action(self, version: str, action: str, actor: str) -> None:
        if action not in ACTIONS:
            raise RegistryError(f"{ACTION_TAG}: must be one of {', '.join(ACTIONS)}, got {action!r}")
        self.set_tags(version, {ACTOR_TAG: actor, ACTION_TAG: action})

    # ----------------------------------------------------------------- the offline eval record
    def eval_record(self, version: str) -> dict[str, Any] | None:
        """What the pipeline's release stage recorded about a version: gates verdict, and metrics if logged."""
        tags = self.tags(version)
        if "lifecycle.gates_passed" not in tags:
            return None
        record: dict[str, Any] = {"passed": tags["lifecycle.gates_passed"] == "true",
                                  "summary": tags.get("lifecycle.gates", "")}
        mv = self._call(f"reading version {version}", self.client.get_model_version, self.model_name, str(version))
        if not mv.run_id:
            return record
        from mlflow.exceptions import MlflowException

        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = self.client.download_artifacts(mv.run_id, "eval_record.json", tmp)
                stored = json.loads(Path(path).read_text())
        except MlflowException:  # a version released before eval_record.json was logged: the verdict is enough
            return record
        except (OSError, ValueError) as exc:  # there but unreadable: judge on the verdict, and say so
            log.warning("%s v%s: cannot read eval_record.json (%s); judging on the gates verdict alone",
                        self.model_name, version, exc)
            return record
        if isinstance(stored, dict):
            record["metrics"] = stored.get("metrics", {})
            record["results"] = stored.get("results") or []
            record["gates"] = stored.get("gates") or {}
        return record
