"""The eval record sits beside the manifest, refers to its digest, and never changes the snapshot."""

from __future__ import annotations

import json

import pytest

from artifacts.errors import EvalRecordError
from artifacts.eval_record import EvalRecord, read_eval_record, write_eval_record
from artifacts.manifest import manifest_digest
from artifacts.verify import verify_bundle


def test_write_and_read_without_changing_the_snapshot(bundle):
    digest = manifest_digest(bundle)
    path = write_eval_record(bundle, metrics={"task_accuracy": 0.5}, gates={"accuracy": {"passed": True}},
                             passed=True)
    assert path.name == "eval_record.json"
    assert manifest_digest(bundle) == digest
    verify_bundle(bundle)
    record = read_eval_record(bundle)
    assert record.manifest_digest == digest and record.metrics == {"task_accuracy": 0.5}
    assert record.passed is True and record.bundle_name == "tiny" and record.bundle_version == "1.0.0"
    # rewriting replaces the record atomically, leaving no temp files behind
    write_eval_record(bundle, EvalRecord(manifest_digest=digest, metrics={"task_accuracy": 0.75}))
    assert read_eval_record(bundle).metrics["task_accuracy"] == 0.75
    assert not [p for p in bundle.iterdir() if p.name.startswith(".")]


def test_record_for_another_manifest_is_refused(bundle):
    write_eval_record(bundle, {"metrics": {"x": 1.0}})
    record = json.loads((bundle / "eval_record.json").read_text())
    record["manifest_digest"] = "0" * 64
    (bundle / "eval_record.json").write_text(json.dumps(record))
    with pytest.raises(EvalRecordError, match="stale or copied"):
        read_eval_record(bundle)
    assert read_eval_record(bundle, check_digest=False).metrics == {"x": 1.0}
    with pytest.raises(EvalRecordError, match="record is for manifest"):
        write_eval_record(bundle, EvalRecord(manifest_digest="f" * 64))


def test_missing_or_malformed_record(bundle):
    with pytest.raises(EvalRecordError, match="missing"):
        read_eval_record(bundle)
    (bundle / "eval_record.json").write_text("{")
    with pytest.raises(EvalRecordError, match="not valid JSON"):
        read_eval_record(bundle)
    with pytest.raises(EvalRecordError, match="unknown field"):
        write_eval_record(bundle, {"bogus": 1})


def test_writer_can_attach_a_record(model_dir, lineage, tmp_path, small_shard_size):
    from artifacts.writer import BundleConfig, write_bundle

    out = write_bundle(model_dir, tmp_path / "b", BundleConfig(name="t", max_shard_size=small_shard_size),
                       lineage, eval_record={"metrics": {"ppl": 3.0}})
    assert read_eval_record(out).metrics == {"ppl": 3.0}
    verify_bundle(out)
