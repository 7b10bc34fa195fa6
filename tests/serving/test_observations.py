"""The gateway's evidence store: the pairs' ms per token side by side, and a store from an older gateway."""

from __future__ import annotations

import sqlite3
import time

from serving.gateway.observations import DB_FILE, ObservationStore, PairRecord


def _pair(ts: float, shadow_version: str = "2", *, primary_ms: float = 100.0, shadow_ms: float = 300.0,
          primary_tokens: int | None = 10, shadow_tokens: int | None = 20, shadow_status: int = 200) -> PairRecord:
    return PairRecord(ts=ts, request_id=f"r{ts}", path="/v1/completions", prompt="p", primary_version="1",
                      shadow_version=shadow_version, primary_status=200, shadow_status=shadow_status,
                      primary_ms=primary_ms, shadow_ms=shadow_ms, primary_text="a", shadow_text="b",
                      exact_match=False, same_answer=None, answer_primary=None, answer_shadow=None,
                      refusal_primary=False, refusal_shadow=False, first_divergence=0, length_ratio=1.0,
                      similarity=0.5, agree=True, primary_tokens=primary_tokens, shadow_tokens=shadow_tokens)


def test_a_window_gives_each_pairs_ms_per_token_side_by_side(tmp_path):
    store = ObservationStore(tmp_path)
    now = time.time()
    store.add(_pair(now))
    store.add(_pair(now + 0.1, primary_ms=50.0, shadow_ms=40.0, primary_tokens=5, shadow_tokens=4))
    store.add(_pair(now + 0.2, shadow_status=500))  # a failed mirror has no latency to compare
    store.add(_pair(now + 0.3, shadow_tokens=None))  # nor an answer whose tokens were not counted
    store.add(_pair(now + 0.4, shadow_version="3"))  # another candidate: its own group
    window = store.window(now - 1)
    store.close()
    groups = {row["shadow_version"]: row for row in window["pairs"]}
    assert groups["2"]["pairs"] == 4
    assert sorted(groups["2"]["ms_per_token"]) == [[10.0, 10.0], [10.0, 15.0]]  # [champion, shadow]
    assert groups["3"]["ms_per_token"] == [[10.0, 15.0]]


def test_a_store_written_by_an_older_gateway_is_brought_up_to_date_and_keeps_its_rows(tmp_path):
    """A restarted gateway keeps its file: columns added since are added to it, nothing is lost."""
    with sqlite3.connect(tmp_path / DB_FILE) as conn:
        conn.executescript(
            "CREATE TABLE requests (ts REAL, request_id TEXT, variant TEXT, version TEXT, replica TEXT, "
            "status INTEGER, error TEXT, ttft_ms REAL, itl_ms REAL, e2e_ms REAL, prompt_tokens INTEGER, "
            "completion_tokens INTEGER, stream INTEGER, probe INTEGER, fallback_to TEXT);"
            "CREATE TABLE pairs (ts REAL, request_id TEXT, path TEXT, prompt TEXT, primary_version TEXT, "
            "shadow_version TEXT, primary_status INTEGER, shadow_status INTEGER, primary_ms REAL, shadow_ms REAL, "
            "primary_text TEXT, shadow_text TEXT, exact_match INTEGER, same_answer INTEGER, answer_primary TEXT, "
            "answer_shadow TEXT, refusal_primary INTEGER, refusal_shadow INTEGER, first_divergence INTEGER, "
            "length_ratio REAL, similarity REAL, agree INTEGER);")
        conn.execute("INSERT INTO pairs (ts, primary_version, shadow_version, primary_status, shadow_status, agree) "
                     "VALUES (?, '1', '2', 200, 200, 1)", (time.time(),))
    store = ObservationStore(tmp_path)
    now = time.time()
    store.add(_pair(now + 0.1))
    window = store.window(now - 60)
    store.close()
    (group,) = window["pairs"]
    assert group["pairs"] == 2 and group["agree"] == 2  # the old row is still counted
    assert group["ms_per_token"] == [[10.0, 15.0]]  # only the new one has tokens to compare
