"""Local dataset loaders: JSONL/JSON/Parquet through `datasets`, errors that name file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset

from artifacts.errors import LifecycleError
from training.loaders import DatasetError, load_local_dataset


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SFT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_loads_each_kind_and_normalizes_plain_strings(tmp_path: Path) -> None:
    assert load_local_dataset(_jsonl(tmp_path / "s.jsonl", [SFT_ROW]), "sft") == [SFT_ROW]
    pref = load_local_dataset(_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}]),
                              "preference")
    assert pref == [{"prompt": [{"role": "user", "content": "q"}],
                     "chosen": [{"role": "assistant", "content": "a"}],
                     "rejected": [{"role": "assistant", "content": "b"}]}]
    row = {"prompt": "1+1?", "answer": 2, "task": "addition"}
    grpo = load_local_dataset(_jsonl(tmp_path / "g.jsonl", [row]), "grpo")
    assert grpo == [{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2", "task": "addition"}]


def test_loads_parquet_and_json(tmp_path: Path) -> None:
    Dataset.from_list([SFT_ROW, SFT_ROW]).to_parquet(str(tmp_path / "s.parquet"))
    assert len(load_local_dataset(tmp_path / "s.parquet", "sft")) == 2
    (tmp_path / "s.json").write_text(json.dumps([SFT_ROW]))
    assert load_local_dataset(tmp_path / "s.json", "sft") == [SFT_ROW]


def test_missing_column_names_file_and_field(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "a"}])
    with pytest.raises(DatasetError, match=r"pairs\.jsonl: missing field 'rejected'"):
        load_local_dataset(path, "preference")
    with pytest.raises(DatasetError, match=r"pairs\.jsonl: missing field 'answer'"):
        load_local_dataset(path, "grpo")
    assert issubclass(DatasetError, LifecycleError)


@pytest.mark.parametrize("name, content, match", [
    ("nope.jsonl", None, "no such file"),
    ("data.csv", "a,b\n", "unsupported file type '.csv'"),
    ("broken.jsonl", "{not json\n", "cannot read as json"),
    ("empty.jsonl", "", "no records|cannot read"),
])
def test_bad_files_raise_dataset_error_naming_the_file(tmp_path: Path, name: str, content: str | None,
                                                       match: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError, match=match) as info:
        load_local_dataset(path, "sft")
    assert str(path) in str(info.value)


def test_bad_records_name_the_row_and_field(tmp_path: Path) -> None:
    bad_role = [{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    with pytest.raises(DatasetError, match="record 0 field 'messages': unknown role 'robot'"):
        load_local_dataset(_jsonl(tmp_path / "a.jsonl", bad_role), "sft")
    no_reply = [SFT_ROW, {"messages": [{"role": "user", "content": "x"}]}]
    with pytest.raises(DatasetError, match="record 1 .*last message must be the assistant"):
        load_local_dataset(_jsonl(tmp_path / "b.jsonl", no_reply), "sft")
    null_answer = [{"prompt": "q", "answer": "1"}, {"prompt": "q", "answer": None}]
    with pytest.raises(DatasetError, match="record 1 has no value for field 'answer'"):
        load_local_dataset(_jsonl(tmp_path / "c.jsonl", null_answer), "grpo")


def test_unknown_kind_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^kind:"):
        load_local_dataset(tmp_path / "x.jsonl", "rlhf")


def test_a_directory_is_every_supported_file_in_it_in_name_order(tmp_path: Path) -> None:
    other = {"messages": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "hey"}]}
    _jsonl(tmp_path / "b.jsonl", [other])
    _jsonl(tmp_path / "a.jsonl", [SFT_ROW])
    (tmp_path / "c.jsonl.tmp").write_text("{half a reco")  # being copied in: skipped
    (tmp_path / ".hidden.jsonl").write_text("{nope")
    (tmp_path / "notes.txt").write_text("ignored")
    assert load_local_dataset(tmp_path, "sft") == [SFT_ROW, other]
    _jsonl(tmp_path / "z.jsonl", [{"messages": [{"role": "user", "content": "no reply"}]}])
    with pytest.raises(DatasetError, match=r"z\.jsonl: record 0 field 'messages'"):
        load_local_dataset(tmp_path, "sft")  # a bad new file fails the load, naming the file and the field
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="no .jsonl, .json or .parquet files"):
        load_local_dataset(empty, "sft")
