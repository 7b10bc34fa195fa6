"""Put a snapshot in front of traffic without a canary: the first champion of a model (nothing to compare
it with), or a deliberate ``--as champion``. A smoke check through the gateway comes first, and the move is
recorded like any rollout: an MLflow run in ``rollouts`` with the alias moves as its audit trail."""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from serving.fleet.gateway_group import GatewayGroup
from serving.rollout.registry_console import RegistryConsole
from serving.rollout.state import RolloutError
from serving.rollout.tracking import RolloutRun

SMOKE_PROMPTS = ("What is 2 + 3?", "Say hello.", "How do I make a kite?")


def smoke_check(gateway_url: str, admin_key: str, variant: str = "champion", max_tokens: int = 8,
                model: str | None = None) -> list[str]:
    """A few chat requests pinned to ``variant`` (of ``model``'s lane, an adapter's public name; None: the base):
    each must answer 200 with a well-formed completion."""
    replies = []
    with httpx.Client(timeout=120, headers={"authorization": f"Bearer {admin_key}"}) as client:
        for prompt in SMOKE_PROMPTS:
            response = client.post(f"{gateway_url}/v1/chat/completions",
                                   headers={"x-lifecycle-variant": variant, "x-lifecycle-probe": "1"},
                                   json={"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                                         "max_tokens": max_tokens, **({"model": model} if model else {})})
            if response.status_code != 200:
                raise RolloutError(f"smoke check: {prompt!r} answered {response.status_code}: {response.text[:200]}")
            body = response.json()
            if not body.get("choices") or body.get("usage", {}).get("completion_tokens", 0) < 1:
                raise RolloutError(f"smoke check: {prompt!r} got no completion")
            replies.append(body["choices"][0]["message"]["content"])
    return replies


def install_champion(*, model_name: str, version: str, replica_url: str, served_model: str, gateway_url: str,
                     admin_key: str, tracking_uri: str, cause: str, actor: str,
                     other_gateway_urls: Sequence[str] = ()) -> dict:
    """Route all traffic to ``version`` after a smoke check (through ``gateway_url``), move the aliases, and
    record it. Every routing change goes to the other gateways in front of the fleet too."""
    console = RegistryConsole(model_name, tracking_uri)
    gateway = GatewayGroup([gateway_url, *other_gateway_urls], admin_key)
    try:
        previous = console.alias_version("champion")
        routing = gateway.routing()
        gateway.set_routing({"shadow": {"replicas": [replica_url], "version": version, "served_model": served_model},
                             "shadow_fraction": 0.0}, actor=actor)  # reachable for the smoke check, no traffic
        try:
            deadline = time.monotonic() + 30
            while gateway.healthy_replicas("shadow")[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            smoke_check(gateway_url, admin_key, "shadow")
        finally:
            gateway.set_routing({"shadow": routing["shadow"], "shadow_fraction": routing["shadow_fraction"]},
                                actor=actor)
        gateway.set_routing({"champion": {"replicas": [replica_url], "version": version,
                                          "served_model": served_model},
                             "canary": {"replicas": [], "version": "", "served_model": ""}, "canary_weight": 0.0},
                            actor=actor)
        moves = []
        if previous and previous != version:
            console.set_alias("previous-champion", previous)
            moves.append(f"previous-champion: → v{previous}")
        if previous != version:
            console.set_alias("champion", version)
            moves.append(f"champion: {'v' + previous if previous else 'unset'} → v{version}")
        console.set_tags(version, {"rollout.state": "champion", "rollout.verdict": "smoke check passed"})
        if previous and previous != version:
            console.set_tags(previous, {"rollout.state": "previous champion"})
        run = RolloutRun(tracking_uri)
        now = time.time()
        run.start(f"{model_name} v{version} installed as champion",
                  {"model": model_name, "candidate_version": version, "champion_version": previous or "none",
                   "start": "champion"},
                  {"rollout.status": "promoted", "rollout.candidate": version, "rollout.reason": cause})
        decisions = [{"at": now, "kind": "phase", "from": "none", "to": "promoted", "cause": cause, "actor": actor,
                      "detail": "smoke check passed"}]
        decisions += [{"at": now, "kind": "alias", "from": "none", "to": "promoted", "cause": cause, "actor": actor,
                       "detail": move} for move in moves]
        run.log_json_lines(decisions, "decision_log.jsonl")
        run.finish("FINISHED")
        console.set_tags(version, {"rollout.run": run.run_id})
        return {"version": version, "previous": previous, "moves": moves, "run_id": run.run_id}
    finally:
        gateway.close()
