"""Reading held-out files: errors name file, line and field; limits keep every stratum."""

from __future__ import annotations

import pytest
from eval_testutil import write_jsonl

from evals.data import messages_problem, read_jsonl, take_stratified
from evals.errors import EvalError


def test_read_jsonl_errors_name_file_line_and_field(tmp_path):
    path = tmp_path / "tasks_heldout.jsonl"
    with pytest.raises(EvalError, match="tasks_heldout.jsonl: data file not found"):
        read_jsonl(path, {"id": str})
    path.write_text('{"id": "a"}\n\n{"id": 3}\n')
    with pytest.raises(EvalError, match=r"tasks_heldout.jsonl:3: field 'id' has the wrong type"):
        read_jsonl(path, {"id": str})
    path.write_text('{"id": "a"}\n{"name": "b"}\n')
    with pytest.raises(EvalError, match=r"tasks_heldout.jsonl:2: missing field 'id'"):
        read_jsonl(path, {"id": str})
    path.write_text('{"id": "a"}\n{not json\n')
    with pytest.raises(EvalError, match=r"tasks_heldout.jsonl:2: not valid JSON"):
        read_jsonl(path, {"id": str})
    path.write_text("\n")
    with pytest.raises(EvalError, match="no records"):
        read_jsonl(path, {"id": str})
    path.write_bytes(b'{"id": "\xff"}\n')
    with pytest.raises(EvalError, match="tasks_heldout.jsonl: not UTF-8"):
        read_jsonl(path, {"id": str})


def test_line_separator_characters_inside_strings_are_kept(tmp_path):
    path = tmp_path / "text_heldout.jsonl"
    path.write_text('{"text": "a\u2028b"}\n{"text": "c"}\n', encoding="utf-8")
    assert [r["text"] for r in read_jsonl(path, {"text": str})] == ["a\u2028b", "c"]


def test_messages_check_reports_the_line(tmp_path):
    path = write_jsonl(tmp_path / "pref_heldout.jsonl", [
        {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
         "rejected": [{"role": "assistant", "content": "b"}]},
        {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant"}],
         "rejected": [{"role": "assistant", "content": "b"}]},
    ])
    with pytest.raises(EvalError, match=r"pref_heldout.jsonl:2: field 'chosen'"):
        read_jsonl(path, {"prompt": list},
                   check=lambda r: messages_problem(r, "prompt", "chosen", "rejected"))


def test_take_stratified_keeps_every_stratum_in_file_order():
    records = [{"task": "a", "i": i} for i in range(10)] + [{"task": "b", "i": i} for i in range(3)]
    picked = take_stratified(records, 6, key=lambda r: r["task"])
    assert len(picked) == 6
    assert [r["task"] for r in picked].count("b") == 3
    assert [r["i"] for r in picked if r["task"] == "a"] == [0, 1, 2]
    assert take_stratified(records, None, key=lambda r: r["task"]) == records
    assert take_stratified(records, 100, key=lambda r: r["task"]) == records
