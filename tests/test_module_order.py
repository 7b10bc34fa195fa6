"""The order the suite hands its modules to the workers (tests/module_order.py): longest first, from the seconds a
recorded run wrote; tests inside a module keep their order; a recorded run updates only the modules it ran."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests import module_order


@pytest.fixture
def seconds_file(tmp_path, monkeypatch):
    path = tmp_path / "module_seconds.json"
    monkeypatch.setattr(module_order, "SECONDS_FILE", path)
    return path


def _items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_modules_go_longest_first_and_keep_their_tests_in_order(seconds_file):
    seconds_file.write_text(json.dumps({"a.py": 3.0, "b.py": 300.0, "c.py": 30.0}))
    items = _items("a.py::t1", "a.py::t2", "new.py::t", "b.py::t", "c.py::t2", "c.py::t1")
    module_order.longest_modules_first(items)
    # new.py is unknown: UNKNOWN_SECONDS (10) puts it between c.py and a.py
    assert [i.nodeid for i in items] == ["b.py::t", "c.py::t2", "c.py::t1", "new.py::t", "a.py::t1", "a.py::t2"]


def test_no_file_keeps_the_collection_order(seconds_file):
    items = _items("z.py::t", "a.py::t", "m.py::t")
    module_order.longest_modules_first(items)
    assert [i.nodeid for i in items] == ["z.py::t", "a.py::t", "m.py::t"]


def test_a_recorded_run_updates_the_modules_it_ran_and_only_a_green_one(seconds_file):
    seconds_file.write_text(json.dumps({"a.py": 3.0, "b.py": 300.0}))
    recorder = module_order.SecondsRecorder()
    for nodeid, duration in [("a.py::t1", 10.0), ("a.py::t1", 2.5), ("c.py::t", 1.0)]:
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=duration))
    session = SimpleNamespace(config=SimpleNamespace())
    recorder.pytest_sessionfinish(session, exitstatus=1)
    assert json.loads(seconds_file.read_text()) == {"a.py": 3.0, "b.py": 300.0}  # a failed run writes nothing
    recorder.pytest_sessionfinish(session, exitstatus=0)
    assert json.loads(seconds_file.read_text()) == {"b.py": 300.0, "a.py": 12.5, "c.py": 1.0}
    assert list(json.loads(seconds_file.read_text())) == ["b.py", "a.py", "c.py"]  # longest first, as read
