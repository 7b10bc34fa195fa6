"""Every gateway in front of one fleet, driven as one by the controller, ``deploy`` and the fleet.

Several gateways (one per host or zone, behind a load balancer) route each conversation to the same variant
because the sticky hash is deterministic and they all hold the same routing: so every routing change goes to
each of them. Each gateway only sees the requests that came through it, so the evidence a phase is judged on
is the union of their observation windows. Reads of the routing, replica health and probes use the first
gateway (they all poll the same replicas).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serving.fleet.errors import FleetError
from serving.fleet.gateway_client import GatewayAdmin

_COUNTS = ("requests", "keys", "status_5xx", "status_429", "fallbacks", "completion_tokens")
_SAMPLES = ("ttft_ms", "itl_ms", "e2e_ms", "ms_per_token")
_PAIR_COUNTS = ("pairs", "shadow_errors", "compared", "exact_match", "with_answer", "same_answer", "agree",
                "refusal_flips")
_PAIR_MEANS = ("similarity", "length_ratio", "primary_ms", "shadow_ms")


class GatewayGroup:
    """``GatewayAdmin``'s interface over one or more gateways."""

    def __init__(self, urls: Sequence[str], admin_key: str, timeout: float = 30.0, lane: str = "") -> None:
        if not urls:
            raise FleetError("no gateway to drive (the fleet has no gateway URL)")
        self.members = [GatewayAdmin(url, admin_key, timeout, lane) for url in dict.fromkeys(urls)]
        self.lane = lane
        self.primary = self.members[0]
        self.url = self.primary.url

    def routing(self) -> dict[str, Any]:
        return self.primary.routing()

    def set_routing(self, patch: dict[str, Any], actor: str) -> dict[str, Any]:
        """The same change on every gateway (each is tried; any failure raises after, naming them all), so a
        retried transition reaches the ones that missed it; the change is idempotent."""
        results, errors = [], []
        for member in self.members:
            try:
                results.append(member.set_routing(dict(patch), actor))
            except FleetError as exc:
                errors.append(str(exc))
        if errors:
            raise FleetError("; ".join(errors))
        return results[0]

    def register_replica(self, name: str, url: str, actor: str) -> None:
        for member in self.members:
            member.register_replica(name, url, actor)

    def forget_replica(self, name: str, actor: str) -> None:
        for member in self.members:
            member.forget_replica(name, actor)

    def window(self, since: float, until: float | None = None, disagreements: int = 10) -> dict[str, Any]:
        return merge_windows([m.window(since, until, disagreements) for m in self.members], disagreements)

    def healthy_replicas(self, variant: str) -> tuple[int, str]:
        return self.primary.healthy_replicas(variant)

    def ask(self, variant: str, body: dict[str, Any], path: str = "/v1/chat/completions"):
        return self.primary.ask(variant, body, path)

    def close(self) -> None:
        for member in self.members:
            member.close()


def merge_windows(windows: list[dict[str, Any]], disagreements: int = 10) -> dict[str, Any]:
    """One observation window from several gateways' windows over the same interval: counts add up, latency
    samples pool, pair means are weighted by their pairs, and the most divergent pairs of all come first.
    Distinct conversation keys add up too, so a key whose requests came through two gateways counts twice."""
    if len(windows) == 1:
        return windows[0]
    variants: dict[tuple[str, str], dict[str, Any]] = {}
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    for window in windows:
        for row in window.get("variants", []):
            into = variants.setdefault((row["variant"], str(row["version"])), {
                "variant": row["variant"], "version": row["version"], **dict.fromkeys(_COUNTS, 0),
                **{name: [] for name in _SAMPLES}})
            for name in _COUNTS:
                into[name] += row.get(name) or 0
            for name in _SAMPLES:
                into[name] += row.get(name) or []
        for row in window.get("pairs", []):
            key = (str(row["primary_version"]), str(row["shadow_version"]))
            into = pairs.setdefault(key, {"primary_version": row["primary_version"],
                                          "shadow_version": row["shadow_version"], **dict.fromkeys(_PAIR_COUNTS, 0),
                                          **{name: [] for name in _PAIR_MEANS}, "ms_per_token": []})
            for name in _PAIR_COUNTS:
                into[name] += row.get(name) or 0
            into["ms_per_token"] += row.get("ms_per_token") or []
            for name in _PAIR_MEANS:
                if row.get(name) is not None:
                    into[name].append((row[name], row.get("pairs") or 0))
    for row in pairs.values():
        for name in _PAIR_MEANS:
            weighted = row[name]
            total = sum(weight for _, weight in weighted)
            row[name] = sum(value * weight for value, weight in weighted) / total if total else None
    worst = sorted((d for window in windows for d in window.get("disagreements", [])), key=_divergence)
    return {"since": min(w["since"] for w in windows), "until": max(w["until"] for w in windows),
            "variants": list(variants.values()), "pairs": list(pairs.values()),
            "disagreements": worst[:disagreements], "gateways": len(windows)}


def _divergence(pair: dict[str, Any]) -> tuple:
    """The gateway's own order for a person to read: refusal flips, then different answers, then least similar."""
    return (-(pair.get("refusal_primary") != pair.get("refusal_shadow")), -(pair.get("same_answer") == 0),
            pair.get("similarity") or 0.0)
