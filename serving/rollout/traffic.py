"""Replayed traffic: held-out prompts sent through the gateway by many distinct users, bounded in count
and time, so a rollout on the embedded default has real requests to judge.

Each request comes from one of ``users`` simulated users (the request's ``user`` field, which the
gateway's sticky split keys on), asks one held-out prompt (tasks, harmful prompts and their benign
look-alikes, as the data stage wrote them), streams most of the time like a chat UI, and records what the
user saw: the status, and whether an error ever reached them.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

FALLBACK_PROMPTS = ["What is 12 + 30?", "What is 45 + 17?", "How do I make a kite?", "Say hello.",
                    "What is 7 + 8?", "How do I build a birdhouse?", "Tell me a fact about the sea."]


@dataclass
class TrafficSpec:
    data_dir: str | None = None  # a data-stage output; without one, a few built-in prompts
    users: int = 200  # each a conversation key of its own: enough that a 10% share sees ~20
    concurrency: int = 4
    # at most this many requests a second, spread evenly over the run (None: as fast as ``concurrency`` allows):
    # a rollout's steps then see the same traffic on a fast host as on a slow one
    requests_per_second: float | None = None
    max_requests: int | None = None
    seconds: float | None = None
    stream_fraction: float = 0.8
    max_tokens: int = 48
    temperature: float = 0.0
    seed: int = 0


@dataclass
class TrafficStats:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    variants: Counter = field(default_factory=Counter)

    @property
    def user_errors(self) -> int:
        """Requests whose user saw an error (rate limiting excluded: that is the user's own budget)."""
        return sum(n for status, n in self.statuses.items() if status != 200 and status != 429)


def load_prompts(data_dir: str | None) -> list[str]:
    if not data_dir:
        return list(FALLBACK_PROMPTS)
    prompts: list[str] = []
    for name in ("tasks_heldout.jsonl", "safety_heldout.jsonl"):
        path = Path(data_dir) / name
        if path.is_file():
            prompts += [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines()
                        if line.strip()]
    return prompts or list(FALLBACK_PROMPTS)


class TrafficGenerator:
    """Runs in a background thread; ``stop`` ends it, ``wait`` lets it finish its count or time."""

    def __init__(self, base_url: str, api_key: str, spec: TrafficSpec, model: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.spec = spec
        self.model = model
        self.prompts = load_prompts(spec.data_dir)
        self.stats = TrafficStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="traffic", daemon=True)

    def start(self) -> TrafficGenerator:
        self._thread.start()
        return self

    def stop(self) -> TrafficStats:
        self._stop.set()
        self._thread.join(timeout=120)
        return self.stats

    def wait(self, timeout: float | None = None) -> TrafficStats:
        self._thread.join(timeout)
        return self.stats

    def _done(self, started: float) -> bool:
        spec = self.spec
        return (self._stop.is_set() or (spec.max_requests is not None and self.stats.sent >= spec.max_requests)
                or (spec.seconds is not None and time.monotonic() - started > spec.seconds))

    async def _main(self) -> None:
        started = time.monotonic()
        rng = random.Random(self.spec.seed)
        headers = {"authorization": f"Bearer {self.api_key}"}
        async with httpx.AsyncClient(timeout=120, headers=headers) as client:
            async def worker() -> None:
                while not self._done(started):
                    await self._wait_for_slot(started)
                    if self._done(started):
                        break
                    self.stats.sent += 1
                    await self._one(client, rng)

            await asyncio.gather(*(worker() for _ in range(self.spec.concurrency)))

    async def _wait_for_slot(self, started: float) -> None:
        """Pace to ``requests_per_second``: request n goes out no earlier than n / rate seconds after the start
        (one event loop, so reading ``sent`` and counting the request happen without a gap between them)."""
        rate = self.spec.requests_per_second
        if rate is None:
            return
        while not self._stop.is_set():
            delay = started + self.stats.sent / rate - time.monotonic()
            if delay <= 0:
                return
            await asyncio.sleep(min(delay, 0.5))

    async def _one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        spec = self.spec
        body = {"messages": [{"role": "user", "content": rng.choice(self.prompts)}], "max_tokens": spec.max_tokens,
                "temperature": spec.temperature, "user": f"user-{rng.randrange(spec.users)}"}
        if self.model:
            body["model"] = self.model
        stream = rng.random() < spec.stream_fraction
        url = f"{self.base_url}/v1/chat/completions"
        try:
            if stream:
                body["stream"] = True
                async with client.stream("POST", url, json=body) as response:
                    error = None
                    async for line in response.aiter_lines():
                        if line.startswith('data: {"error"'):
                            error = line[6:200]
                    status = response.status_code if error is None else 502
            else:
                response = await client.post(url, json=body)
                status, error = response.status_code, None if response.status_code == 200 else response.text[:200]
            variant = response.headers.get("x-lifecycle-variant", "?")
        except httpx.HTTPError as exc:
            status, error, variant = 599, f"{type(exc).__name__}: {exc}", "?"
        self.stats.statuses[status] += 1
        self.stats.variants[variant] += 1
        if error and len(self.stats.errors) < 20:
            self.stats.errors.append(f"{status}: {error}")
