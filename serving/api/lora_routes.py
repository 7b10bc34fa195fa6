"""LoRA adapters over HTTP, as vLLM names the routes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (an admin key's), and the adapters ``--lora-modules`` names at start.

Why an admin key: loading reads a path on the server's disk and changes what every client may ask for, so it
is an operator's act, like the gateway's admin routes; without ``--admin-key-file`` the routes answer 403
(vLLM keeps them behind an environment flag for the same reason). A request's ``model`` then picks an adapter
(``OpenAIServing.adapter_of``); /v1/models lists each with its ``parent``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request

from artifacts.adapter_bundle import verify_for_serving
from artifacts.errors import BundleError
from serving.api.errors import APIError, engine_api_error
from serving.api.request_parsing import read_json_body
from serving.api.server_state import ServerState
from serving.engine.errors import EngineError

log = logging.getLogger(__name__)


def require_admin(request: Request, state: ServerState) -> None:
    if state.admin_key is None:
        raise APIError(403, "loading adapters while serving is off: start the server with --admin-key-file",
                       "permission_error")
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), state.admin_key.encode()):
        raise APIError(401, "this route needs the server's admin key (Authorization: Bearer ...)",
                       "authentication_error")


def _field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise APIError(400, f"{name}: required, a non-empty string", param=name)
    return value.strip()


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        require_admin(request, state)
        body = await read_json_body(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if name == state.model_name:
            raise APIError(400, f"lora_name: {name!r} is the base model's name", param="lora_name")
        try:
            if state.model_dir is not None:  # an adapter bundle must name the served snapshot as its base
                await asyncio.to_thread(verify_for_serving, path, state.model_dir)
            await state.engine_client.load_lora(name, path)
        except BundleError as e:
            raise APIError(400, f"lora_path: {path}: {e}", param="lora_path") from e
        except EngineError as e:
            raise engine_api_error(e) from e
        log.info("LoRA adapter %s loaded from %s", name, path)
        return {"object": "lora_adapter", **model_card(state, name)}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        require_admin(request, state)
        name = _field(await read_json_body(request), "lora_name")
        try:
            await state.engine_client.unload_lora(name)
        except EngineError as e:
            raise engine_api_error(e) from e
        log.info("LoRA adapter %s unloaded", name)
        return {"object": "lora_adapter", "id": name, "deleted": True}


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    """One /v1/models entry: the base, or an adapter with its ``parent``."""
    card = {"id": name, "object": "model", "created": 0, "owned_by": "llm-lifecycle",
            "max_model_len": state.engine.max_model_len, "parent": None}
    adapter = state.engine_client.adapters.get(name)
    if adapter is not None:
        card.update(parent=state.model_name, root=adapter.path, lora_rank=adapter.rank,
                    digest=f"sha256:{adapter.digest}")
    return card


async def load_startup_adapters(state: ServerState, modules: dict[str, str]) -> None:
    """The adapters ``--lora-modules`` named, loaded before the server says it is ready."""
    for name, path in modules.items():
        await state.engine_client.load_lora(name, path)
        log.info("LoRA adapter %s loaded from %s", name, path)
