"""So a failed night is not silent: a flow hook that records every failed or crashed lifecycle run.

Each failure appends one JSON line to ``<workdir>/notifications.log`` (what failed, the run, the one-line
cause) and, when ``LIFECYCLE_NOTIFY_WEBHOOK`` is set, POSTs the same JSON there (a chat webhook, an alert
manager). A hook never raises: a broken notifier must not hide the failure it reports.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)
WEBHOOK_ENV = "LIFECYCLE_NOTIFY_WEBHOOK"


def failure_record(flow: Any, flow_run: Any, state: Any) -> dict[str, Any]:
    message = (state.message or "").strip().splitlines()
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "flow": getattr(flow, "name", "?"),
            "flow_run": getattr(flow_run, "name", "?"), "flow_run_id": str(getattr(flow_run, "id", "")),
            "state": state.name, "parameters": dict(getattr(flow_run, "parameters", {}) or {}),
            "cause": message[0][:500] if message else state.name}


def notify_failure(flow: Any, flow_run: Any, state: Any) -> None:
    try:
        from artifacts.common.workdir import resolve_workdir

        record = failure_record(flow, flow_run, state)
        sink = resolve_workdir().root / "notifications.log"
        sink.parent.mkdir(parents=True, exist_ok=True)
        with open(sink, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, default=str) + "\n")
        webhook = os.environ.get(WEBHOOK_ENV)
        if webhook:
            import httpx

            httpx.post(webhook, json=record, timeout=10)
    except Exception as exc:  # noqa: BLE001 - see the module docstring
        log.warning("could not deliver the failure notification: %s", exc)
