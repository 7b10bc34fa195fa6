"""Deployments of the lifecycle flow on a Prefect server, with schedules: the unattended loop.

A deployment runs `flows/lifecycle.py:lifecycle` on one recipe, from this checkout, on a process work pool
(so `lifecycle worker`, or `prefect worker start --pool lifecycle`, runs it). Every deployment allows one
run at a time and cancels a run that comes due while the previous one is still going (Prefect's
`CANCEL_NEW`): the next run picks up whatever arrived meanwhile, instead of a queue of nights piling up.
A run's time limit comes from the deployment (`LIFECYCLE_RUN_TIMEOUT_S`, read when the worker loads the
flow). The same deployment moves to a Docker or Kubernetes work pool by changing `--pool` to such a pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artifacts.common.workdir import REPO_ROOT
from artifacts.errors import ConfigError, LifecycleError

DEFAULT_POOL = "lifecycle"
TAG = "lifecycle"
ENTRYPOINT = "flows/lifecycle.py:lifecycle"
_INTERVAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class ScheduleError(LifecycleError):
    """A schedule cannot be created or changed (no server, a bad interval, an unknown deployment)."""


def parse_interval(text: str) -> dt.timedelta:
    """'90s', '15m', '6h', '1d' → a timedelta."""
    match = _INTERVAL.match(text)
    if not match:
        raise ConfigError(f"--interval: cannot parse {text!r} (examples: 30s, 15m, 6h, 1d)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds < 1:
        raise ConfigError(f"--interval: must be at least 1s, got {text!r}")
    return dt.timedelta(seconds=seconds)


def check_cron(text: str) -> str:
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=text)
    except ValueError:
        raise ConfigError(f"--cron: {text!r} is not a cron expression (e.g. '0 3 * * *' for 03:00 daily)") from None
    return text


@dataclass
class DeploymentRow:
    name: str
    recipe: str
    schedule: str
    paused: bool
    pool: str
    last_run: str
    next_run: str


def _run(coro):
    try:
        return asyncio.run(coro)
    except LifecycleError:
        raise
    except Exception as exc:  # noqa: BLE001 - connection refused and friends: one line, not a traceback
        from prefect.settings import PREFECT_API_URL

        raise ScheduleError(f"Prefect server at {PREFECT_API_URL.value() or '(ephemeral)'}: "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                            "(is `lifecycle server` running?)") from None


async def _ensure_pool(client, pool: str) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    try:
        await client.read_work_pool(pool)
    except ObjectNotFound:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="process"))


def create_schedule(recipe_path: str | Path, *, name: str | None, cron: str | None, interval: str | None,
                    pool: str = DEFAULT_POOL, timeout_s: float = 6 * 3600, env: dict[str, str] | None = None) -> str:
    """Create (or replace) the deployment `lifecycle/<name>` of the recipe; returns its full name."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    from flows.recipe import load_recipe

    recipe_path = Path(recipe_path).resolve()
    recipe = load_recipe(recipe_path)  # a bad recipe is refused now, not at 03:00
    if (cron is None) == (interval is None):
        raise ConfigError("schedule: give exactly one of --cron or --interval")
    name = name or recipe.name
    kwargs: dict[str, Any] = {"cron": check_cron(cron)} if cron else {"interval": parse_interval(interval)}

    async def pool_ready() -> None:
        async with get_client() as client:
            await client.hello()
            await _ensure_pool(client, pool)

    _run(pool_ready())
    deployable = flow.from_source(source=str(REPO_ROOT), entrypoint=ENTRYPOINT)
    with contextlib.redirect_stdout(io.StringIO()):  # Prefect's own banner and table; our caller prints one line
        deployable.deploy(
            name=name, work_pool_name=pool, parameters={"recipe_path": str(recipe_path)}, tags=[TAG, recipe.name],
            description=f"the lifecycle of {recipe_path.name} ({'cron ' + cron if cron else 'every ' + interval})",
            concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
            job_variables={"env": {"LIFECYCLE_RUN_TIMEOUT_S": str(int(timeout_s)), **(env or {})}},
            print_next_steps=False, ignore_warnings=True, **kwargs)
    return f"lifecycle/{name}"


def _schedule_text(schedules: list[Any]) -> str:
    texts = []
    for item in schedules:
        sched = item.schedule
        if getattr(sched, "cron", None):
            texts.append(f"cron {sched.cron}")
        elif getattr(sched, "interval", None):
            texts.append(f"every {sched.interval}")
        else:
            texts.append(str(sched))
    return ", ".join(texts) or "none"


def list_schedules() -> list[DeploymentRow]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterTags,
        FlowRunFilter,
        FlowRunFilterDeploymentId,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    async def fetch() -> list[DeploymentRow]:
        rows = []
        async with get_client() as client:
            deployments = await client.read_deployments(
                deployment_filter=DeploymentFilter(tags=DeploymentFilterTags(all_=[TAG])))
            for d in deployments:
                runs = await client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[d.id])),
                    sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=50)
                done = [r for r in runs if r.state and r.state.is_final()]
                upcoming = [r for r in runs if r.state and r.state.is_scheduled()]
                last = f"{done[0].name} {done[0].state.name}" if done else "–"
                nxt = min((r.expected_start_time for r in upcoming), default=None)
                rows.append(DeploymentRow(d.name, str(d.parameters.get("recipe_path", "")),
                                          _schedule_text(d.schedules), bool(d.paused), d.work_pool_name or "",
                                          last, nxt.strftime("%Y-%m-%d %H:%M:%S") if nxt else "–"))
        return rows

    return _run(fetch())


def set_paused(name: str, paused: bool) -> None:
    """Pause or resume a deployment's schedule. Pausing also deletes the runs its schedule has queued: Prefect's
    own pause deletes them too, but the scheduler service may be inserting its next batch at that moment (it read
    the deployment as active just before), and those runs would fire for minutes after the pause (seen in
    tests/flows/test_schedule.py: 80 runs inserted 0.2 s after the pause, firing for 8 minutes). A run that slips
    through even so ends at once (``skip_reason``)."""
    from prefect.client.orchestration import get_client

    async def change() -> None:
        async with get_client() as client:
            deployment = await _read(client, name)
            await client.set_deployment_paused_state(deployment.id, paused)
            if paused:
                await _delete_queued_runs(client, deployment.id)

    _run(change())


async def _delete_queued_runs(client, deployment_id) -> int:
    """Delete the deployment's runs that its schedule created and that have not started; returns how many."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound

    queued = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
    deleted = 0
    for run in queued:
        if run.auto_scheduled:  # a run a person asked for stays
            with contextlib.suppress(ObjectNotFound):  # picked up or deleted meanwhile
                await client.delete_flow_run(run.id)
                deleted += 1
    return deleted


def skip_reason(auto_scheduled: bool, deployment_paused: bool, deployment_name: str) -> str | None:
    """Why a run of a deployment should do nothing: its schedule made it, and the schedule is paused now (it was
    queued before the pause). A run a person started from a paused deployment runs."""
    if auto_scheduled and deployment_paused:
        return f"skipped: the schedule of lifecycle/{deployment_name} is paused (this run was queued before the pause)"
    return None


def current_run_skip_reason() -> str | None:
    """``skip_reason`` for the flow run this process executes; None outside a deployment, or when the server
    cannot say (the run then goes on, as it would have before the check existed). The run's own record comes
    from the flow's context; only a run its schedule made asks the server about the deployment (not through
    ``prefect.runtime.deployment``, whose lookup leaves the context unpicklable for Ray's stage tasks)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run = getattr(context, "flow_run", None)
    if run is None or run.deployment_id is None or not run.auto_scheduled:
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            current = client.read_deployment(run.deployment_id)
    except Exception:  # noqa: BLE001 - a server hiccup must not stop a scheduled run
        return None
    return skip_reason(True, bool(current.paused), current.name)


def delete_schedule(name: str) -> None:
    from prefect.client.orchestration import get_client

    async def remove() -> None:
        async with get_client() as client:
            deployment = await _read(client, name)
            await client.delete_deployment(deployment.id)

    _run(remove())


async def _read(client, name: str):
    from prefect.exceptions import ObjectNotFound

    full = name if "/" in name else f"lifecycle/{name}"
    try:
        return await client.read_deployment_by_name(full)
    except ObjectNotFound:
        raise ScheduleError(f"{full}: no such deployment (see `lifecycle schedule list`)") from None
