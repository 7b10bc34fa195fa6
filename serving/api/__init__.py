"""OpenAI-compatible API server over the engine."""

from serving.api.server import build_app, load_engine, run_server

__all__ = ["build_app", "load_engine", "run_server"]
