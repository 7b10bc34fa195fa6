"""The replayed traffic's rate cap: a rollout step sees the same number of requests on a fast host as on a slow one.

The server here is a plain HTTP server on 127.0.0.1 that answers every chat completion at once (the subject is the
generator's pacing, not a model), and records when each request arrived.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from artifacts.errors import ConfigError
from flows.recipe import load_recipe
from serving.rollout.traffic import TrafficGenerator, TrafficSpec


class _InstantServer:
    def __init__(self) -> None:
        arrivals: list[float] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                arrivals.append(time.monotonic())
                self.rfile.read(int(self.headers["content-length"]))
                body = json.dumps({"choices": [{"message": {"content": "ok"}}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("x-lifecycle-variant", "champion")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.arrivals = arrivals
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    s = _InstantServer()
    yield s
    s.close()


def test_a_rate_cap_spreads_requests_evenly_however_fast_the_server_answers(server):
    rate, seconds = 40.0, 3.0
    stats = TrafficGenerator(server.url, "key", TrafficSpec(concurrency=4, requests_per_second=rate, seconds=seconds,
                                                            stream_fraction=0.0)).start().wait(timeout=30)
    assert stats.statuses == {200: stats.sent}
    assert abs(stats.sent - rate * seconds) <= 3, stats.sent
    # evenly: every half second holds its share of 20, give or take 8 (a loaded host's event loop can stall for a
    # moment and the paced requests catch up after it); unpaced, the first half second would hold them all
    first = server.arrivals[0]
    per_half_second = [sum(1 for t in server.arrivals if k / 2 <= t - first < (k + 1) / 2) for k in range(5)]
    assert all(rate / 2 - 8 <= n <= rate / 2 + 8 for n in per_half_second), per_half_second


def test_without_a_cap_the_traffic_runs_as_fast_as_its_workers_allow(server):
    stats = TrafficGenerator(server.url, "key", TrafficSpec(concurrency=4, seconds=1.0, stream_fraction=0.0)
                             ).start().wait(timeout=30)
    assert stats.statuses == {200: stats.sent}
    assert stats.sent > 2 * 40, stats.sent  # the capped run above sends 40 a second; this one is not held to it


def test_a_stop_ends_a_paced_run_that_is_waiting_for_its_next_slot(server):
    traffic = TrafficGenerator(server.url, "key", TrafficSpec(concurrency=2, requests_per_second=0.2,
                                                              stream_fraction=0.0)).start()
    time.sleep(0.5)
    started = time.monotonic()
    stats = traffic.stop()
    assert time.monotonic() - started < 2 and stats.sent == 1  # the first request; the next is 5 s away


@pytest.mark.parametrize("value", [0, -5])
def test_a_recipe_cap_that_is_not_positive_is_one_line_naming_it(tmp_path, value):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"traffic": {"requests_per_second": value}}}))
    with pytest.raises(ConfigError, match=f"rollout.traffic: requests_per_second: must be > 0 .*got {value}") as caught:
        load_recipe(path)
    assert str(caught.value).startswith(str(path)) and "\n" not in str(caught.value)
