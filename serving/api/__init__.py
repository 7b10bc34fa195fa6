"""OpenAI-compatible API server over the engine.

Laid out as vLLM's: ``protocol`` (request and answer schemas), ``openai_serving`` (the engine side of a
request, which the handlers share, over ``errors``, ``request_parsing``, ``sampling_factory``, ``generation``
and ``sse``), ``completion`` and ``chat`` (the handlers), ``app`` (routes, health, metrics, OpenAPI),
``server`` (the process: load, serve, drain on SIGTERM). ``engine_client`` is the handlers' side of an engine
stepping elsewhere: ``thread_engine_client`` in a thread of this process, ``process_engine_client`` in its own
process (``serving.engine.core_process``), which ``engine_view`` shows to the handlers.
"""

from serving.api.app import build_app
from serving.api.server import load_engine, run_server

__all__ = ["build_app", "load_engine", "run_server"]
