"""OpenAI-compatible API server over the engine.

Laid out as vLLM's: ``protocol`` (request and answer schemas), ``common`` (what the handlers share),
``completion`` and ``chat`` (the handlers), ``app`` (routes, health, metrics, OpenAPI), ``server`` (the
process: load, serve, drain on SIGTERM).
"""

from serving.api.app import build_app
from serving.api.server import load_engine, run_server

__all__ = ["build_app", "load_engine", "run_server"]
