"""The API's errors and the one place an engine error becomes an HTTP status.

Whatever way an engine error reaches a handler (raised while adding a request, or put in its output queue
later), it answers the same: bad input 400 naming the field, a full queue 429 with Retry-After, a draining,
stopped or shutting-down engine 503, anything else 500.
"""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from serving.api.engine_client import EngineDeadError, RequestAbortedError
from serving.api.protocol import error_body
from serving.engine import EngineDrainingError, InvalidRequestError, LoraError, QueueFullError, UnknownAdapterError


class APIError(Exception):
    """Answered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers
        self.code = code  # OpenAI's error code where it has one (``model_not_found``); else the status

    def body(self) -> dict:
        """The OpenAI error object, as a JSON answer or an SSE error event carries it."""
        return error_body(self.message, self.type, self.param, self.code or self.status)


class ClientDisconnectedError(Exception):
    """The client of a non-streaming request went away before the answer; its engine requests are aborted.

    Routine (a client timeout), so it is logged as one INFO line, never as an exception in the app.
    """

    def __init__(self, request_id: str, aborted: int) -> None:
        super().__init__(f"{request_id}: client disconnected; aborted {aborted} engine request(s)")
        self.request_id, self.aborted = request_id, aborted


def model_not_found(message: str) -> APIError:
    """404 for a ``model`` this server does not serve (neither its base nor a loaded adapter), as OpenAI says it."""
    return APIError(404, message, "not_found_error", "model", code="model_not_found")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def engine_api_error(e: BaseException) -> APIError:
    """The HTTP answer to an engine error, raised at admission or delivered in a request's queue."""
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, UnknownAdapterError):
        return model_not_found(str(e).partition(": ")[2] or str(e))
    if isinstance(e, LoraError):
        return APIError(400, str(e), param="lora_path")
    if isinstance(e, QueueFullError):  # the engine's queue (or the core process's) is at max_queue
        return APIError(429, str(e), "rate_limit_error",
                        headers={"Retry-After": str(max(1, math.ceil(e.retry_after)))})
    # draining, a stopped engine, or the drain timeout ending the request: in a stream an error event then
    # [DONE], which our gateway takes as a broken stream and continues on another replica
    if isinstance(e, (EngineDrainingError, EngineDeadError, RequestAbortedError)):
        return APIError(503, str(e), "service_unavailable")
    return APIError(500, f"engine failure: {e}", "server_error")
