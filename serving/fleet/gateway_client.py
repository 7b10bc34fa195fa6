"""The controller's side of the gateway's admin API (and of its probe path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from serving.fleet.errors import FleetError


def read_secret(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise FleetError(f"{path}: cannot read the admin key ({exc.strerror})") from None


class GatewayAdmin:
    def __init__(self, url: str, admin_key: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
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
        return self._request("PUT", "/admin/routing", "changing the routing", json=patch,
                             headers={"x-lifecycle-actor": actor})

    def register_replica(self, name: str, url: str, actor: str) -> dict[str, Any]:
        """Tell the gateway where a named replica answers now (routed there wherever its old address was)."""
        return self._request("PUT", f"/admin/replicas/{name}", "registering a replica", json={"url": url},
                             headers={"x-lifecycle-actor": actor})

    def forget_replica(self, name: str, actor: str) -> dict[str, Any]:
        return self._request("DELETE", f"/admin/replicas/{name}", "forgetting a replica",
                             headers={"x-lifecycle-actor": actor})

    def window(self, since: float, until: float | None = None, disagreements: int = 10) -> dict[str, Any]:
        params: dict[str, Any] = {"since": since, "disagreements": disagreements}
        if until is not None:
            params["until"] = until
        return self._request("GET", "/admin/window", "reading the observation window", params=params)

    def healthy_replicas(self, variant: str) -> tuple[int, str]:
        """How many replicas of a variant take traffic now, and the last error of one that does not."""
        replicas = [r for r in self.routing()["replicas"] if r["variant"] == variant]
        healthy = [r for r in replicas if r["healthy"]]
        errors = [r["last_error"] for r in replicas if not r["healthy"] and r["last_error"]]
        return len(healthy), (errors[0] if errors else "")

    def ask(self, variant: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
        """One probe request, pinned to a variant and kept out of the traffic statistics."""
        return self.client.post(self.url + path, json=body, headers={"x-lifecycle-variant": variant,
                                                                      "x-lifecycle-probe": "1"})

    def close(self) -> None:
        self.client.close()
