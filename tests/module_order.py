"""The order in which the suite hands its modules to the xdist workers: longest first.

`make test` runs a module to a worker (``--dist loadfile``). xdist's own order is by number of tests, most first,
which puts the one-test end-to-end modules (the scheduled lifecycle, 6 minutes; the pipeline, 3) last: the run
ended with one worker on them and the other idle for minutes. Handing modules out longest first (and one at a
time, ``--no-loadscope-reorder`` keeping this order) is the classic longest-processing-time rule: the tail is one
short module, not one long one.

The weights are each module's seconds in a recent run of the whole suite, kept in ``module_seconds.json`` beside
this file; ``make test PYTEST_ARGS=--record-module-seconds`` rewrites it from the run it ends. A module the file
does not know yet weighs ``UNKNOWN_SECONDS``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).with_name("module_seconds.json")
UNKNOWN_SECONDS = 10.0  # a new module: about a typical one of the suite's
RECORD_OPTION = "--record-module-seconds"


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def known_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(SECONDS_FILE.read_text()).items()}
    except (OSError, ValueError):
        return {}


def longest_modules_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: modules by their known seconds, longest first; tests within a module (and
    modules of equal weight) keep their collection order."""
    seconds = known_seconds()
    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(_module_of(item.nodeid), index)

    def key(indexed: tuple[int, pytest.Item]) -> tuple[float, int, int]:
        index, item = indexed
        module = _module_of(item.nodeid)
        return -seconds.get(module, UNKNOWN_SECONDS), first_seen[module], index

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


class SecondsRecorder:
    """Sums each module's setup, call and teardown time as reports arrive (on the xdist controller too), and
    at the end of a run without failures writes them over the known ones (modules it did not run keep theirs)."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[_module_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus != 0 or hasattr(session.config, "workerinput"):
            return  # a failed run's times are not the suite's; a worker leaves it to the controller
        merged = known_seconds() | {module: round(s, 1) for module, s in self.seconds.items()}
        table = dict(sorted(merged.items(), key=lambda kv: -kv[1]))
        tmp = SECONDS_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        tmp.replace(SECONDS_FILE)


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(RECORD_OPTION, action="store_true",
                     help=f"rewrite {SECONDS_FILE.name} (the order modules are handed to workers) from this run")


def configure(config: pytest.Config) -> None:
    if config.getoption(RECORD_OPTION) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(SecondsRecorder(), "module-seconds-recorder")
