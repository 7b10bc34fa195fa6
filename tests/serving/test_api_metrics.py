"""`/metrics` is valid Prometheus exposition, and every family it exposes is documented in docs/serving.md."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.engine import EngineConfig
from tests.serving.test_api_server import MODEL, running_server

SERVING_DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=4)) as s:
        yield s


def documented_metric_table() -> dict[str, str]:
    """`vllm:*` family → type, from the table in docs/serving.md's "Metrics" section."""
    text = SERVING_DOC.read_text()
    section = text[text.index("\n## Metrics"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\|\s*`(vllm:[^`]+)`\s*\|\s*(\w+)\s*\|", section, re.MULTILINE)
    assert rows, "no metric table in docs/serving.md's Metrics section"
    return dict(rows)


def test_metrics_parse_as_prometheus_text_and_are_all_documented(server):
    base, _ = server
    httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    with httpx.stream("POST", f"{base}/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "stream": True}) as r:
        r.read()
    resp = httpx.get(f"{base}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    assert families and all(name.startswith("vllm:") for name in families), sorted(families)
    documented = documented_metric_table()
    assert set(families) == set(documented), {"undocumented": sorted(set(families) - set(documented)),
                                              "documented but not exposed": sorted(set(documented) - set(families))}
    for name, family in families.items():
        assert family.type == documented[name], (name, family.type, documented[name])
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample
    # the values mean what the table says
    value = {s.name: s.value for f in families.values() for s in f.samples if not s.labels.keys() - {"model_name"}}
    assert value["vllm:generation_tokens_total"] >= 8
    assert value["vllm:prompt_tokens_total"] >= 2
    assert value["vllm:e2e_request_latency_seconds_count"] >= 2
    assert value["vllm:num_requests_running"] == 0
    assert value["vllm:engine_steps_total"] >= 4 and value["vllm:engine_steps_overlapped_total"] == 0  # CPU: sync
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples}
    assert sum(success.values()) >= 2
