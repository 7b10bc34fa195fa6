"""Manifest records: JSON round trip, stable text, schema version."""

from __future__ import annotations

import pytest

from artifacts.errors import BundleVerificationError
from artifacts.manifest import Manifest, manifest_digest, read_manifest


def test_json_round_trip_is_lossless_and_stable(session_bundle):
    text = (session_bundle / "manifest.json").read_text()
    manifest = Manifest.from_json(text)
    assert manifest.to_json() == text  # same text, so the same digest
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert read_manifest(session_bundle) == manifest
    assert len(manifest_digest(session_bundle)) == 64
    assert manifest.shard_plan.weight_map == {n: t.shard for n, t in manifest.shard_plan.tensors.items()}


@pytest.mark.parametrize("text, reason", [
    ("[]", "not a JSON object"),
    ("{", "not valid JSON"),
    ('{"schema_version": 1, "name": "x"}', "malformed manifest"),
    ('{"schema_version": 2}', "schema_version 2 is not supported"),
])
def test_bad_manifests_are_refused_with_a_reason(text, reason):
    with pytest.raises(BundleVerificationError, match=f"^manifest.json: {reason}"):
        Manifest.from_json(text)
