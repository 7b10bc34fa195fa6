"""Errors the gateway answers with, in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
