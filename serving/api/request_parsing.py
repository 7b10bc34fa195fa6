"""Reading a generation request: the body as JSON, then as the request model, and the request id.

Parsed here, not by FastAPI, so every bad body is an OpenAI-style 400 naming the field (never a 422).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from serving.api.errors import APIError
from serving.api.protocol import find_lone_surrogate

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_INNER_FIELD = re.compile(r"^(?P<field>[A-Za-z_][\w.]*): (?P<why>.+)$", re.DOTALL)


def _field_path(loc: tuple) -> list[str]:
    """A pydantic error location without the union-member tags (`str`, `list[int]`) it interleaves."""
    return [str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]


def parse_request(model_cls: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        # For a field that accepts several shapes pydantic reports one error per shape; the deepest one
        # names what the client most likely meant (`messages.0.content.0.text`, not `content.str`).
        worst = max(e.errors(), key=lambda err: len(_field_path(err.get("loc", ()))))
        path = _field_path(worst.get("loc", ()))
        message = str(worst.get("msg")).removeprefix("Value error, ")
        inner = _INNER_FIELD.match(message)  # a model validator's own "field.sub: why" goes deeper still
        if inner:
            path, message = [*path, inner["field"]], inner["why"]
        loc = ".".join(path) or None
        raise APIError(400, f"{loc}: {message}" if loc else message, param=loc) from e


async def read_json_body(request: Request) -> Any:
    """The body as JSON; a body that is not JSON, or not Unicode text, is a 400."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from e
    where = find_lone_surrogate(body)
    if where is not None:
        raise APIError(400, f"{where}: contains a lone UTF-16 surrogate, which is not valid Unicode text",
                       param=where)
    return body


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def _given_request_id(request: Request) -> str | None:
    given = request.headers.get("x-request-id")
    return given if given and _REQUEST_ID.match(given) else None


def request_id(request: Request) -> str:
    """The client's (or the gateway's) ``X-Request-Id`` when it is a sane token, else a fresh one; the
    response ``id`` carries it, as vLLM's does, so one id follows a request through every hop."""
    return _given_request_id(request) or uuid.uuid4().hex


def id_header(request: Request) -> dict[str, str]:
    """The client's sane ``X-Request-Id`` to send back with the answer (none when it sent none)."""
    given = _given_request_id(request)
    return {"x-request-id": given} if given else {}
