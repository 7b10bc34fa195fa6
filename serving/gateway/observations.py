"""What the gateway saw, per request and per shadow pair, in SQLite: the rollout controller's evidence.

Writes never block the event loop: records go onto a queue that one writer thread commits in batches.
Reads (the admin API's window query) run in a worker thread on their own connection; WAL mode lets them
run while the writer writes. The file lives in the gateway's state directory, so a restarted gateway
keeps the evidence of the step in progress.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

DB_FILE = "observations.db"
MAX_SAMPLES = 20_000  # latency samples returned per variant and window
_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    ts REAL, request_id TEXT, variant TEXT, version TEXT, replica TEXT, status INTEGER, error TEXT,
    ttft_ms REAL, itl_ms REAL, e2e_ms REAL, prompt_tokens INTEGER, completion_tokens INTEGER,
    stream INTEGER, probe INTEGER, fallback_to TEXT, conversation TEXT, lane TEXT
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE TABLE IF NOT EXISTS pairs (
    ts REAL, request_id TEXT, path TEXT, prompt TEXT, primary_version TEXT, shadow_version TEXT,
    primary_status INTEGER, shadow_status INTEGER, primary_ms REAL, shadow_ms REAL,
    primary_text TEXT, shadow_text TEXT, exact_match INTEGER, same_answer INTEGER,
    answer_primary TEXT, answer_shadow TEXT, refusal_primary INTEGER, refusal_shadow INTEGER,
    first_divergence INTEGER, length_ratio REAL, similarity REAL, agree INTEGER,
    primary_tokens INTEGER, shadow_tokens INTEGER, lane TEXT
);
CREATE INDEX IF NOT EXISTS pairs_ts ON pairs (ts);
"""


@dataclass
class RequestRecord:
    """One upstream attempt (a request that fell back to the champion leaves two)."""

    ts: float
    request_id: str
    variant: str
    version: str
    replica: str
    status: int  # HTTP status; 599 when the replica could not be reached or broke mid-stream
    error: str | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None  # mean gap between streamed chunks of this request
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    stream: bool = False
    probe: bool = False
    fallback_to: str | None = None  # the variant that answered instead, when this attempt failed
    conversation: str | None = None  # a short hash of the sticky key: how many users a variant saw
    lane: str = ""  # the adapter lane (its public name) the request was for; "" for the base model


@dataclass
class PairRecord:
    ts: float
    request_id: str
    path: str
    prompt: str
    primary_version: str
    shadow_version: str
    primary_status: int
    shadow_status: int
    primary_ms: float | None
    shadow_ms: float | None
    primary_text: str
    shadow_text: str
    exact_match: bool
    same_answer: bool | None
    answer_primary: str | None
    answer_shadow: str | None
    refusal_primary: bool
    refusal_shadow: bool
    first_divergence: int | None
    length_ratio: float
    similarity: float
    agree: bool
    primary_tokens: int | None = None  # completion tokens of each answer: the pair's ms per token, side by side
    shadow_tokens: int | None = None
    lane: str = ""


_STOP = object()


class ObservationStore:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / DB_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as conn:
            conn.executescript(_SCHEMA)
            _add_missing_columns(conn, "requests", {"conversation": "TEXT"})  # a store from before keys were counted
            # ... and from before a pair kept its token counts
            _add_missing_columns(conn, "pairs", {"primary_tokens": "INTEGER", "shadow_tokens": "INTEGER"})
            # ... and from before adapters had lanes (its rows are the base's: NULL reads as "")
            _add_missing_columns(conn, "requests", {"lane": "TEXT"})
            _add_missing_columns(conn, "pairs", {"lane": "TEXT"})
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, name="observations-writer", daemon=True)
        self._thread.start()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    # ----------------------------------------------------------------- writing
    def add(self, record: RequestRecord | PairRecord) -> None:
        self._queue.put(record)

    def flush(self, timeout: float = 10.0) -> None:
        """Return once everything added so far is committed."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    def _write_loop(self) -> None:
        conn = self._connect()
        req_cols = [f.name for f in fields(RequestRecord)]
        pair_cols = [f.name for f in fields(PairRecord)]
        req_sql = f"INSERT INTO requests ({','.join(req_cols)}) VALUES ({','.join('?' * len(req_cols))})"
        pair_sql = f"INSERT INTO pairs ({','.join(pair_cols)}) VALUES ({','.join('?' * len(pair_cols))})"
        while True:
            batch = [self._queue.get()]
            while len(batch) < 512:
                try:
                    batch.append(self._queue.get(timeout=0.05))
                except queue.Empty:
                    break
            requests = [tuple(getattr(r, c) for c in req_cols) for r in batch if isinstance(r, RequestRecord)]
            pairs = [tuple(getattr(r, c) for c in pair_cols) for r in batch if isinstance(r, PairRecord)]
            if requests:
                conn.executemany(req_sql, requests)
            if pairs:
                conn.executemany(pair_sql, pairs)
            if requests or pairs:
                conn.commit()
            for item in batch:
                if isinstance(item, threading.Event):
                    item.set()
            if any(item is _STOP for item in batch):
                conn.close()
                return

    # ----------------------------------------------------------------- reading
    def window(self, since: float, until: float | None = None, disagreements: int = 10, lane: str = ""
               ) -> dict[str, Any]:
        """Everything the controller judges a step on, for requests to ``lane`` (``""``: the base model) that
        arrived in [since, until)."""
        self.flush()
        until = until if until is not None else time.time() + 1
        conn = self._connect()
        scope = _Scope(since, until, lane)
        try:
            return {"since": since, "until": until, "lane": lane, "variants": self._variants(conn, scope),
                    "pairs": self._pairs(conn, scope),
                    "disagreements": self._disagreements(conn, scope, disagreements)}
        finally:
            conn.close()

    @staticmethod
    def _variants(conn: sqlite3.Connection, scope: _Scope) -> list[dict[str, Any]]:
        out = []
        groups = conn.execute("SELECT variant, version, COUNT(*), SUM(status >= 500), SUM(status = 429), "
                              "SUM(fallback_to IS NOT NULL), SUM(COALESCE(completion_tokens, 0)), "
                              "COUNT(DISTINCT conversation) FROM requests "
                              f"WHERE {scope.where} AND probe = 0 GROUP BY variant, version",
                              scope.params).fetchall()
        for variant, version, n, n5xx, n429, fallbacks, tokens, keys in groups:
            def samples(column: str, variant: str = variant, version: str = version) -> list[float]:
                rows = conn.execute(f"SELECT {column} FROM requests WHERE {scope.where} AND probe = 0 AND "
                                    f"variant = ? AND version = ? AND status = 200 AND ({column}) IS NOT NULL "
                                    f"ORDER BY ts DESC LIMIT ?", (*scope.params, variant, version, MAX_SAMPLES))
                return [r[0] for r in rows]

            out.append({"variant": variant, "version": version, "requests": n, "keys": keys or 0,
                        "status_5xx": n5xx or 0,
                        "status_429": n429 or 0, "fallbacks": fallbacks or 0, "completion_tokens": tokens or 0,
                        "ttft_ms": samples("ttft_ms"), "itl_ms": samples("itl_ms"), "e2e_ms": samples("e2e_ms"),
                        # end to end per output token: comparable between a stream and a mirrored plain request
                        "ms_per_token": samples("e2e_ms / completion_tokens")})
        return out

    @staticmethod
    def _pairs(conn: sqlite3.Connection, scope: _Scope) -> list[dict[str, Any]]:
        rows = conn.execute(
            "SELECT primary_version, shadow_version, COUNT(*), SUM(shadow_status != 200), "
            "SUM(primary_status = 200 AND shadow_status = 200), SUM(exact_match), "
            "SUM(same_answer IS NOT NULL), SUM(COALESCE(same_answer, 0)), SUM(agree), "
            "SUM(refusal_primary != refusal_shadow), AVG(similarity), AVG(length_ratio), "
            f"AVG(primary_ms), AVG(shadow_ms) FROM pairs WHERE {scope.where} "
            "GROUP BY primary_version, shadow_version", scope.params).fetchall()
        keys = ("primary_version", "shadow_version", "pairs", "shadow_errors", "compared", "exact_match",
                "with_answer", "same_answer", "agree", "refusal_flips", "similarity", "length_ratio",
                "primary_ms", "shadow_ms")
        out = []
        for row in rows:
            group = dict(zip(keys, row))
            # ms per output token of both answers to each mirrored request, [primary, shadow]: the shadow
            # latency gate compares them pair by pair, so what the host did at that moment hits both sides
            group["ms_per_token"] = [list(r) for r in conn.execute(
                f"SELECT primary_ms / primary_tokens, shadow_ms / shadow_tokens FROM pairs WHERE {scope.where} "
                "AND primary_version = ? AND shadow_version = ? AND primary_status = 200 AND shadow_status = 200 "
                "AND primary_tokens > 0 AND shadow_tokens > 0 ORDER BY ts DESC LIMIT ?",
                (*scope.params, group["primary_version"], group["shadow_version"], MAX_SAMPLES))]
            out.append(group)
        return out

    @staticmethod
    def _disagreements(conn: sqlite3.Connection, scope: _Scope, limit: int) -> list[dict[str, Any]]:
        """The pairs a person should read first: refusal flips, then different answers, then least similar."""
        cur = conn.execute(
            f"SELECT * FROM pairs WHERE {scope.where} AND agree = 0 AND primary_status = 200 AND "
            "shadow_status = 200 ORDER BY (refusal_primary != refusal_shadow) DESC, "
            "(same_answer = 0) DESC, similarity ASC LIMIT ?", (*scope.params, limit))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]


@dataclass(frozen=True)
class _Scope:
    """A window's rows: arrived in [since, until), for one lane (a store's rows from before lanes are the base's)."""

    since: float
    until: float
    lane: str

    where = "ts >= ? AND ts < ? AND COALESCE(lane, '') = ?"

    @property
    def params(self) -> tuple[float, float, str]:
        return self.since, self.until, self.lane


def _add_missing_columns(conn: sqlite3.Connection, table: str, columns: dict[str, str]) -> None:
    """Bring a store written by an older gateway up to this schema (a restarted gateway keeps its file)."""
    present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    for name, kind in columns.items():
        if name not in present:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
