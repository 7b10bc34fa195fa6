"""Who is asking, and whether the gateway can take the request: a sane request id, the API key (an admin key
for the admin API), the conversation key the sticky split keys on, and the fields the gateway reads itself,
refused with the 400 our server would answer before any budget or replica is spent on them."""

from __future__ import annotations

import hashlib
import re
import uuid

import orjson
from fastapi import Request

from serving.gateway.errors import GatewayError
from serving.gateway.keys import ApiKey, KeyStore

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
SESSION_HEADER = "x-session-id"
OPEN_KEY = ApiKey(name="anonymous", sha256="0" * 64)


def request_id_of(request: Request) -> str:
    """The client's ``X-Request-Id`` when it is a sane token, else a fresh one."""
    given = request.headers.get("x-request-id")
    if given and _REQUEST_ID.match(given):
        return given
    return f"gw-{uuid.uuid4().hex}"


def authenticate(request: Request, keys: KeyStore | None, *, admin: bool = False) -> ApiKey:
    if keys is None:
        if admin:
            raise GatewayError(403, "the admin API needs a keys file (start the gateway with keys_file)",
                               "permission_error", "admin_disabled")
        return OPEN_KEY
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise GatewayError(401, "missing API key: send `Authorization: Bearer <key>`", "invalid_request_error",
                           "invalid_api_key")
    key = keys.verify(secret.strip())
    if key is None:
        raise GatewayError(401, "incorrect API key provided", "invalid_request_error", "invalid_api_key")
    if admin and not key.admin:
        raise GatewayError(403, f"key {key.name!r} is not an admin key", "permission_error", "not_admin")
    return key


def conversation_key(request: Request, key: ApiKey, body: dict) -> str | None:
    """What the sticky split keys on: ``X-Session-Id``, else the request's ``user``, else the API key."""
    conversation = request.headers.get(SESSION_HEADER) or body.get("user") or (
        key.name if key is not OPEN_KEY else None)
    return None if conversation is None else str(conversation)


def short_hash(text: str) -> str:
    """Observations keep users apart without keeping who they are."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_fields(body: dict, path: str) -> None:
    """Refuse, with the 400 our server would answer, a field the gateway itself reads (``stream_options``,
    chat content parts) when it has the wrong shape: before any budget or replica is spent on it."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise GatewayError(400, "stream_options: must be an object", param="stream_options")
    if "chat" not in path or body.get("messages") is None:
        return
    messages = body["messages"]
    if not isinstance(messages, list):
        raise GatewayError(400, "messages: must be an array of messages", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise GatewayError(400, f"messages.{i}: a message must be an object", param=f"messages.{i}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise GatewayError(400, f"messages.{i}.content: must be a string or an array of content parts",
                               param=f"messages.{i}.content")
        for j, part in enumerate(content):
            where = f"messages.{i}.content.{j}"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise GatewayError(400, f"{where}: a content part must be an object with a string `type`",
                                   param=where)
            text = part.get("text")
            if text is not None and not isinstance(text, str):
                raise GatewayError(400, f"{where}.text: must be a string, got {orjson.dumps(text).decode()[:40]}",
                                   param=f"{where}.text")
            if part["type"] == "text" and text is None:
                raise GatewayError(400, f"{where}.text: a text part needs a string `text`", param=f"{where}.text")
