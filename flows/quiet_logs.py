"""Keep tracebacks of user errors out of Prefect's logs, and libraries' housekeeping out of the terminal.

Prefect logs a failed task or flow with its traceback. For a `LifecycleError` (bad recipe, bad dataset,
bad bundle) the traceback is noise: the message already names the file and the reason, and the CLI
prints it as the one-line answer. Other exceptions keep their tracebacks: those are bugs.
"""

from __future__ import annotations

import logging

from artifacts.errors import LifecycleError

_PREFECT_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "prefect.flow_engine", "prefect.task_engine")
# INFO lines that narrate a library's housekeeping ("Creating initial MLflow database tables...") on a new workdir
_HOUSEKEEPING_LOGGERS = ("mlflow.store.db.utils", "alembic.runtime.migration")


class DropUserErrorTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, LifecycleError):
            record.exc_info = None
            record.exc_text = None
        return True


def install() -> None:
    from artifacts.common.quiet import quiet_warnings

    quiet_warnings()
    user_errors = DropUserErrorTracebacks()
    for name in _PREFECT_LOGGERS:
        logging.getLogger(name).addFilter(user_errors)
    for name in _HOUSEKEEPING_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
