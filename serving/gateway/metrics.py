"""Prometheus metrics of the gateway, labelled by variant, so a dashboard compares champion and canary.

Names carry the ``lifecycle_gateway_`` prefix; latencies are what a client sees through the gateway
(TTFT to the first streamed token, inter-token gaps between streamed chunks, end-to-end). An adapter lane's
variants are labelled ``ADAPTER/VARIANT`` (``support/canary``), so each adapter rollout has its own series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5,
                1.0)


def variant_label(lane: str, variant: str) -> str:
    """The ``variant`` label of a request to ``lane`` (``""``: the base model)."""
    return f"{lane}/{variant}" if lane else variant


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lifecycle_gateway_requests", "Upstream attempts by variant and HTTP status.",
                                ["variant", "version", "code"], registry=r)
        self.ttft = Histogram("lifecycle_gateway_time_to_first_token_seconds",
                              "Arrival at the gateway to the first streamed token.", ["variant"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("lifecycle_gateway_inter_token_latency_seconds",
                             "Gap between consecutive streamed chunks.", ["variant"], buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("lifecycle_gateway_request_latency_seconds", "Arrival to the last byte.",
                             ["variant"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("lifecycle_gateway_tokens", "Tokens by variant and kind (prompt, completion).",
                              ["variant", "kind"], registry=r)
        self.rejected = Counter("lifecycle_gateway_rejected", "Requests refused at the gateway, by reason.",
                                ["reason"], registry=r)
        self.fallbacks = Counter("lifecycle_gateway_fallbacks",
                                 "Requests retried on another replica or variant before their first byte.",
                                 ["from_variant", "to_variant"], registry=r)
        self.shadow_pairs = Counter("lifecycle_gateway_shadow_pairs",
                                    "Mirrored requests compared, by outcome (agree, disagree, shadow_error).",
                                    ["outcome"], registry=r)
        self.shadow_exact = Counter("lifecycle_gateway_shadow_exact_matches",
                                    "Mirrored pairs whose texts are identical.", registry=r)
        self.shadow_dropped = Counter("lifecycle_gateway_shadow_dropped",
                                      "Mirrors not sent because the shadow budget was spent.", ["reason"],
                                      registry=r)
        self.replica_up = Gauge("lifecycle_gateway_replica_up", "1 when a replica takes traffic, 0 when ejected.",
                                ["variant", "replica"], registry=r)
        self.canary_weight = Gauge("lifecycle_gateway_canary_weight_percent",
                                   "Share of conversations routed to the canary.", registry=r)
        self.baseline_weight = Gauge("lifecycle_gateway_baseline_weight_percent",
                                     "Share of conversations routed to the baseline (the champion's snapshot on "
                                     "fresh replicas, judged against the canary).", registry=r)
        self.shadow_fraction = Gauge("lifecycle_gateway_shadow_fraction",
                                     "Share of champion requests mirrored to the shadow.", registry=r)
        self.in_flight = Gauge("lifecycle_gateway_requests_in_flight", "Requests being answered.", ["variant"],
                               registry=r)
