"""OpenAI-compatible API server over the engine.

Laid out as vLLM's: ``protocol`` (request and answer schemas), ``common`` (what the handlers share),
``completion`` and ``chat`` (the handlers), ``app`` (routes, health, metrics, OpenAPI), ``server`` (the
process: load, serve, drain on SIGTERM), ``async_engine`` and ``engine_client`` (the handlers' side of an
engine stepping in a thread, or in its own process, ``serving.engine.core_process``).
"""

from serving.api.app import build_app
from serving.api.server import load_engine, run_server

__all__ = ["build_app", "load_engine", "run_server"]
