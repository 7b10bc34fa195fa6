"""The controller's side of the gateway's admin API (and of its probe path).

Scoped to a lane: the controller of an adapter's rollout drives that adapter's lane (its routing, its window,
its probes, which name the adapter as their model), and never touches the base's routing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from serving.fleet.errors import FleetError

VARIANTS = ("champion", "canary", "shadow", "baseline")


def read_secret(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise FleetError(f"{path}: cannot read the admin key ({exc.strerror})") from None


class GatewayAdmin:
    def __init__(self, url: str, admin_key: str, timeout: float = 30.0, lane: str = "") -> None:
        self.url = url.rstrip("/")
        self.lane = lane  # an adapter's public name: this client drives its lane; "" the base routing
        self.headers = {"authorization": f"Bearer {admin_key}"}
        self.client = httpx.Client(timeout=timeout, headers=self.headers)

    def _check(self, response: httpx.Response, what: str) -> Any:
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise FleetError(f"gateway {self.url}: {what} answered {response.status_code}: {message}")
        return response.json()

    def _request(self, method: str, path: str, what: str, **kwargs) -> Any:
        try:
            return self._check(self.client.request(method, self.url + path, **kwargs), what)
        except httpx.TransportError as exc:
            raise FleetError(f"gateway {self.url}: {what} failed ({type(exc).__name__})") from None

    def routing(self) -> dict[str, Any]:
        return self._request("GET", "/admin/routing", "reading the routing")

    def set_routing(self, patch: dict[str, Any], actor: str) -> dict[str, Any]:
        """Change the base routing, or this client's lane (whose variants have no replicas of their own: the
        replica lists a rollout's transition names are the base's and are left out)."""
        if self.lane:
            patch = {k: ({f: x for f, x in v.items() if f != "replicas"} if isinstance(v, dict) and k in VARIANTS
                         else v) for k, v in patch.items()}
            return self._request("PUT", f"/admin/lanes/{self.lane}", f"changing the lane {self.lane}", json=patch,
                                 headers={"x-lifecycle-actor": actor})
        return self._request("PUT", "/admin/routing", "changing the routing", json=patch,
                             headers={"x-lifecycle-actor": actor})

    def delete_lane(self, lane: str, actor: str) -> dict[str, Any]:
        """Remove an adapter's lane (its public name then answers 404 at this gateway)."""
        return self._request("DELETE", f"/admin/lanes/{lane}", f"removing the lane {lane}",
                             headers={"x-lifecycle-actor": actor})

    def register_replica(self, name: str, url: str, actor: str) -> dict[str, Any]:
        """Tell the gateway where a named replica answers now (routed there wherever its old address was)."""
        return self._request("PUT", f"/admin/replicas/{name}", "registering a replica", json={"url": url},
                             headers={"x-lifecycle-actor": actor})

    def forget_replica(self, name: str, actor: str) -> dict[str, Any]:
        return self._request("DELETE", f"/admin/replicas/{name}", "forgetting a replica",
                             headers={"x-lifecycle-actor": actor})

    def window(self, since: float, until: float | None = None, disagreements: int = 10) -> dict[str, Any]:
        params: dict[str, Any] = {"since": since, "disagreements": disagreements, "lane": self.lane}
        if until is not None:
            params["until"] = until
        return self._request("GET", "/admin/window", "reading the observation window", params=params)

    def healthy_replicas(self, variant: str) -> tuple[int, str]:
        """How many replicas of a variant take traffic now, and the last error of one that does not (a lane's
        variants are served by the champion's replicas)."""
        pool = "champion" if self.lane else variant
        replicas = [r for r in self.routing()["replicas"] if r["variant"] == pool]
        healthy = [r for r in replicas if r["healthy"]]
        errors = [r["last_error"] for r in replicas if not r["healthy"] and r["last_error"]]
        return len(healthy), (errors[0] if errors else "")

    def ask(self, variant: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
        """One probe request, pinned to a variant (of this client's lane) and kept out of the traffic statistics."""
        if self.lane:
            body = {**body, "model": self.lane}
        return self.client.post(self.url + path, json=body, headers={"x-lifecycle-variant": variant,
                                                                      "x-lifecycle-probe": "1"})

    def close(self) -> None:
        self.client.close()
