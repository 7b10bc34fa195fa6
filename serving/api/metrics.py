"""Prometheus metrics with vLLM's names, so existing dashboards and gateways read them.

Gauges and cumulative counters come from ``engine.stats()`` at scrape time (a custom collector);
latency histograms are observed by the engine thread as outputs come out. Each server owns its own
``CollectorRegistry`` (no global state; several servers can live in one test process).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.engine import RequestOutput

if TYPE_CHECKING:  # the API process never imports torch (see serving.api.engine_view)
    from serving.engine import LLMEngine

# No `<name>_created` series (a timestamp gauge per counter and histogram): vLLM turns them off too, and
# with them each family shows up twice in a scrape. A process-wide switch in prometheus_client.
prometheus_client.disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterable:
        s = self.engine.stats()
        lab = ["model_name"]
        val = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric(val, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=lab)
            c.add_metric(val, v)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Sequences preempted (recomputed later).", s.num_preemptions)
        yield counter("vllm:engine_steps", "Engine steps launched (forward passes).", s.num_steps)
        yield counter("vllm:engine_steps_overlapped", "Engine steps waited for while the next one was already "
                      "launched (async scheduling; their host work overlapped the device's).", s.num_steps_overlapped)
        yield counter("vllm:prompt_tokens", "Prompt tokens received.", s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        # zero unless the server speculates (--speculative-tokens): dashboards need not special-case it
        yield counter("vllm:spec_decode_num_draft_tokens", "Guessed tokens checked (n-gram speculation).",
                      s.spec_draft_tokens_total)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Guessed tokens the model agreed with.",
                      s.spec_accepted_tokens_total)
        yield gauge("vllm:spec_decode_draft_acceptance_rate", "Accepted / checked guessed tokens so far.",
                    s.spec_acceptance_rate)
        yield gauge("vllm:spec_decode_draft_cost_ratio", "A draft model's pass over a target step, as "
                    "measured (0 without a draft model or before a measurement).", s.spec_draft_cost_ratio)
        # vLLM's shape: the adapters in labels, the scrape time as the value (max_lora "0": adapters are off)
        info = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters running and waiting requests use.",
                                 labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([self.model_name, str(s.max_loras), ",".join(s.lora_running), ",".join(s.lora_waiting)],
                        time.time())
        yield info


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        lab = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", lab,
                             buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", lab,
                             buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.rejected = Counter("vllm:request_rejected", "Requests refused (queue full or draining).",
                                ["model_name", "reason"], registry=self.registry)
        self._last_token: dict[str, float] = {}

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after each step."""
        now = time.monotonic()
        for o in outputs:
            rid = o.request_id
            if o.delta_token_ids:
                prev = self._last_token.get(rid)
                if prev is None:
                    if o.first_token_time is not None:
                        self.ttft.observe(max(0.0, o.first_token_time - o.arrival_time))
                else:
                    self.itl.observe(now - prev)
                self._last_token[rid] = now
            if o.finished:
                self._last_token.pop(rid, None)
                self.e2e.observe(max(0.0, now - o.arrival_time))
                self.success.labels(self.model_name, o.finish_reason or "abort").inc()
