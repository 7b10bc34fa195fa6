"""What one API server holds, shared by its routes, handlers and the process that drains it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from serving.api.engine_client import EngineClient
from serving.api.engine_view import EngineView
from serving.api.metrics import ServerMetrics

if TYPE_CHECKING:  # the API process of `lifecycle serve` never imports torch
    from serving.engine import LLMEngine


@dataclass
class ServerState:
    engine: LLMEngine | EngineView  # what the handlers read about the engine (tokenizer, defaults, limits)
    engine_client: EngineClient  # where requests go: a step thread here, or the engine-core process
    metrics: ServerMetrics
    model_name: str
    ready: bool = False
    admin_key: str | None = None  # the operator's key for the adapter routes (None: those routes are off)
    model_dir: str | None = None  # what is served (an adapter bundle loaded later must name it as its base)
